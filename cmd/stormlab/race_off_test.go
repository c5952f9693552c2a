//go:build !race

package stormlab

const raceEnabled = false
