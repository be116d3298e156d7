// Package hoptrace times one call at a time at fixed points along the CSI
// path (caller, front end, broker, proxy), to say where the chain's added
// latency goes. It is compiled in only with the build tag hoptrace
// (`go test -tags hoptrace -run '^$' -bench HopTrace ./test/bench/`);
// without it Mark is empty and costs nothing.
//
// Calls are told apart by a process-wide call number the benchmark sets
// before each call, so the timings mean something only for calls made one
// at a time, all in one process (test/bench runs the front end, broker and
// proxy in the benchmark's process, the driver in another).
package hoptrace

// Point is a place on the path, in the order a call passes it.
type Point int

// The points. The caller's two are marked by the benchmark.
const (
	CallerSends      Point = iota // the caller starts the call
	FERequestWhole                // front end: the request is whole (reader)
	FEWorkerStarts                // front end: the call's goroutine starts
	FEBegun                       // front end: span, context and metadata made
	AttemptStarts                 // broker: one attempt starts (after routing, the logical span, timeouts)
	RequestQueued                 // broker: the request's frames are buffered, not yet written
	RequestWritten                // broker: the request is written to the proxy (TLS write returned)
	ProxyRequestRead              // proxy: the request's HEADERS read from the broker
	ProxyRequestSent              // proxy: its first write to the driver after that
	ProxyAnswerRead               // proxy: the answer's HEADERS read from the driver
	ProxyAnswerSent               // proxy: its first write to the broker after that
	AnswerEnded                   // broker: the connection's reader has the whole answer
	WorkerResumes                 // broker: the call's goroutine runs again
	FEAnswerWritten               // front end: the answer is written to the caller
	CallerReturns                 // the caller has the answer
	NumPoints
)

var names = [NumPoints]string{
	"caller sends", "front end: request whole", "front end: call goroutine starts", "front end: span and context made",
	"broker: attempt starts", "broker: request framed", "broker: request written (TLS)", "proxy: request read",
	"proxy: request written to the driver", "proxy: answer read from the driver", "proxy: answer written to the broker",
	"broker: answer whole (reader)", "broker: call goroutine resumes", "front end: answer written", "caller returns",
}

func (p Point) String() string {
	if p >= 0 && p < NumPoints {
		return names[p]
	}
	return "?"
}
