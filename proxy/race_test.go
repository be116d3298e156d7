//go:build race

package proxy

// raceEnabled: the race detector slows every call several times over.
const raceEnabled = true
