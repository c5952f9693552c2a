//go:build race

package main

// raceEnabled: the race detector slows every process of the fleet several
// times over, so the lab's timings made under it are not the lab's.
const raceEnabled = true
