//go:build race

package interceptor

// raceEnabled: under the race detector sync.Pool drops a share of what is
// put back, so allocation counts of pooled paths are not what users get.
const raceEnabled = true
