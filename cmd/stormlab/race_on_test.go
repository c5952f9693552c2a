//go:build race

package stormlab

// raceEnabled: the race detector slows every goroutine several times over
// and unevenly, so latency measurements made under it are not the lab's.
const raceEnabled = true
