package sampledriver_test

import (
	"fmt"

	"github.com/csibroker/csibroker/internal/sampledriver"
)

// The --fault flag of "csibroker sample-driver" takes this syntax.
func ExampleParseFault() {
	method, f, err := sampledriver.ParseFault("CreateVolume=latency:50ms,rate:0.5,code:Unavailable")
	if err != nil {
		panic(err)
	}
	fmt.Println(method, f.Latency, f.Rate, f.Code)
	fmt.Println(sampledriver.FormatFault(method, f))

	// A code alone fails every call; "after" lets the call take effect
	// first, as when a reply is lost.
	_, f, _ = sampledriver.ParseFault("DeleteVolume=after,code:DEADLINE_EXCEEDED")
	fmt.Println(f.Rate, f.After, f.Code)
	// Output:
	// CreateVolume 50ms 0.5 Unavailable
	// CreateVolume=latency:50ms,rate:0.5,code:Unavailable
	// 1 true DeadlineExceeded
}
