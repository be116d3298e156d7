package sampledriver

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// FaultExitCode is the exit status of a process stopped by an exit-after
// fault, distinct from the usual 1 (error) and 2 (usage).
const FaultExitCode = 86

// AllMethods is the Faults.Methods key that applies to every method without
// an entry of its own.
const AllMethods = "*"

// Fault is what the interceptor does to calls of one method.
type Fault struct {
	// Latency is added before the call is handled (cut short when the
	// caller's context ends).
	Latency time.Duration
	// Rate is the probability in [0, 1] that a call fails with Code.
	Rate float64
	// First makes the first N calls of the method fail with Code.
	First int64
	// Code is the injected error's code (OK, the zero value, means
	// Unavailable).
	Code codes.Code
	// After injects the error after the call was handled, so its effect
	// is kept but the caller sees a failure (a lost reply).
	After bool
	// ExitAfter stops the process (Faults.Exit) when the Nth call of this
	// method has been handled, before its reply is sent.
	ExitAfter int64
}

func (f Fault) failing() bool { return f.Rate > 0 || f.First > 0 }

// Faults configures fault injection. The zero value injects nothing.
type Faults struct {
	// Methods holds a Fault per CSI method name ("CreateVolume",
	// "NodePublishVolume", ...) or AllMethods.
	Methods map[string]Fault
	// ExitAfter stops the process when the Nth call of any method has
	// been handled, before its reply is sent (0: never).
	ExitAfter int64
	// Exit is called with FaultExitCode to stop the process (default
	// os.Exit). If it returns, the call fails with Unavailable and the
	// driver keeps serving.
	Exit func(code int)
	// Seed seeds the random source behind Rate (0: random).
	Seed uint64
}

// Validate checks method names, rates and counts.
func (f Faults) Validate() error {
	var errs []error
	for m, ft := range f.Methods {
		if m != AllMethods && !knownMethods[m] {
			errs = append(errs, fmt.Errorf("fault for unknown method %q", m))
		}
		if !(ft.Rate >= 0 && ft.Rate <= 1) { // NaN too
			errs = append(errs, fmt.Errorf("fault %s: rate %v not in [0, 1]", m, ft.Rate))
		}
		if ft.Latency < 0 || ft.First < 0 || ft.ExitAfter < 0 {
			errs = append(errs, fmt.Errorf("fault %s: negative latency or count", m))
		}
		if ft.Code > codes.Unauthenticated {
			errs = append(errs, fmt.Errorf("fault %s: unknown code %d", m, ft.Code))
		}
	}
	if f.ExitAfter < 0 {
		errs = append(errs, fmt.Errorf("exit after %d: must not be negative", f.ExitAfter))
	}
	return errors.Join(errs...)
}

// String formats the faults in ParseFault syntax, separated by spaces.
func (f *Faults) String() string {
	if f == nil {
		return ""
	}
	names := make([]string, 0, len(f.Methods))
	for m := range f.Methods {
		names = append(names, m)
	}
	sort.Strings(names)
	parts := make([]string, 0, len(names))
	for _, m := range names {
		parts = append(parts, FormatFault(m, f.Methods[m]))
	}
	return strings.Join(parts, " ")
}

// Set parses one fault in ParseFault syntax and adds it, so that *Faults is a
// flag.Value for a repeatable flag. A method given twice keeps the last.
func (f *Faults) Set(spec string) error {
	m, ft, err := ParseFault(spec)
	if err != nil {
		return err
	}
	if f.Methods == nil {
		f.Methods = map[string]Fault{}
	}
	f.Methods[m] = ft
	return nil
}

func (f Faults) clone() Faults {
	if f.Methods != nil {
		m := make(map[string]Fault, len(f.Methods))
		for k, v := range f.Methods {
			m[k] = v
		}
		f.Methods = m
	}
	return f
}

// ParseFault parses "Method=key:value,key:value", for example
//
//	CreateVolume=latency:50ms,rate:0.5,code:Unavailable
//	NodePublishVolume=first:2,code:Internal
//	DeleteVolume=after,code:DeadlineExceeded
//	CreateVolume=exit-after:3
//	*=latency:5ms
//
// Method is a CSI method name or "*" (every method without its own entry).
// Keys: latency (a Go duration), rate (0..1), first (fail the first N calls),
// code (a gRPC code name such as Unavailable or RESOURCE_EXHAUSTED, or its
// number; default Unavailable), after (fail after the call took effect) and
// exit-after (stop the process when the Nth call was handled). A code or
// after with neither rate nor first means rate 1; rate:0 (or first:0) given
// means no failure, whatever the code.
func ParseFault(spec string) (method string, f Fault, err error) {
	method, rest, ok := strings.Cut(strings.TrimSpace(spec), "=")
	method = strings.TrimSpace(method)
	if !ok || method == "" {
		return "", Fault{}, fmt.Errorf("fault %q: want Method=key:value[,key:value...]", spec)
	}
	if method != AllMethods && !knownMethods[method] {
		return "", Fault{}, fmt.Errorf("fault %q: unknown CSI method %q", spec, method)
	}
	codeSet, countSet := false, false
	for _, kv := range strings.Split(rest, ",") {
		kv = strings.TrimSpace(kv)
		if kv == "" {
			continue
		}
		k, v, _ := strings.Cut(kv, ":")
		k, v = strings.ToLower(strings.TrimSpace(k)), strings.TrimSpace(v)
		var perr error
		switch k {
		case "latency", "delay":
			f.Latency, perr = time.ParseDuration(v)
		case "rate":
			f.Rate, perr = strconv.ParseFloat(v, 64)
			countSet = true
		case "first":
			f.First, perr = strconv.ParseInt(v, 10, 64)
			countSet = true
		case "code":
			f.Code, perr = ParseCode(v)
			if perr == nil && f.Code == codes.OK {
				perr = errors.New("OK is not an error")
			}
			codeSet = true
		case "after":
			f.After = true
			if v != "" {
				f.After, perr = strconv.ParseBool(v)
			}
		case "exit-after", "exit_after", "exitafter":
			f.ExitAfter, perr = strconv.ParseInt(v, 10, 64)
		default:
			perr = errors.New("unknown key (want latency, rate, first, code, after or exit-after)")
		}
		if perr != nil {
			return "", Fault{}, fmt.Errorf("fault %q: %s: %w", spec, k, perr)
		}
	}
	if !codeSet {
		f.Code = codes.Unavailable
	}
	if (codeSet || f.After) && !countSet {
		f.Rate = 1
	}
	fs := Faults{Methods: map[string]Fault{method: f}}
	if err := fs.Validate(); err != nil {
		return "", Fault{}, fmt.Errorf("fault %q: %w", spec, err)
	}
	return method, f, nil
}

// FormatFault is the inverse of ParseFault.
func FormatFault(method string, f Fault) string {
	var parts []string
	if f.Latency > 0 {
		parts = append(parts, "latency:"+f.Latency.String())
	}
	codeSaid := f.failing() || f.Code != codes.Unavailable
	// rate:0 said when a code or after alone would mean rate 1.
	if f.Rate > 0 || !f.failing() && (codeSaid || f.After) {
		parts = append(parts, "rate:"+strconv.FormatFloat(f.Rate, 'g', -1, 64))
	}
	if f.First > 0 {
		parts = append(parts, "first:"+strconv.FormatInt(f.First, 10))
	}
	if codeSaid {
		parts = append(parts, "code:"+f.Code.String())
	}
	if f.After {
		parts = append(parts, "after")
	}
	if f.ExitAfter > 0 {
		parts = append(parts, "exit-after:"+strconv.FormatInt(f.ExitAfter, 10))
	}
	return method + "=" + strings.Join(parts, ",")
}

// ParseCode parses a gRPC code name in any case, with or without
// underscores ("Unavailable", "RESOURCE_EXHAUSTED"), or its number.
func ParseCode(s string) (codes.Code, error) {
	if n, err := strconv.ParseUint(s, 10, 32); err == nil {
		if n > uint64(codes.Unauthenticated) {
			return 0, fmt.Errorf("unknown code %d", n)
		}
		return codes.Code(n), nil
	}
	want := normCode(s)
	for c := codes.OK; c <= codes.Unauthenticated; c++ {
		if normCode(c.String()) == want {
			return c, nil
		}
	}
	return 0, fmt.Errorf("unknown code %q", s)
}

func normCode(s string) string {
	return strings.ToLower(strings.ReplaceAll(strings.TrimSpace(s), "_", ""))
}

// knownMethods holds the short names of every CSI unary method.
var knownMethods = func() map[string]bool {
	m := map[string]bool{}
	for _, sd := range []grpc.ServiceDesc{csi.Identity_ServiceDesc, csi.Controller_ServiceDesc, csi.Node_ServiceDesc, csi.GroupController_ServiceDesc} {
		for _, md := range sd.Methods {
			m[md.MethodName] = true
		}
	}
	return m
}()

// shortMethod turns "/csi.v1.Controller/CreateVolume" into "CreateVolume".
func shortMethod(full string) string {
	if i := strings.LastIndexByte(full, '/'); i >= 0 {
		return full[i+1:]
	}
	return full
}

// callCounter counts calls per method and in total, and keeps when the
// last maxCallTimes calls of each method arrived.
type callCounter struct {
	mu     sync.Mutex
	byName map[string]int64
	total  int64
	times  map[string][]time.Time // up to 2*maxCallTimes, the last maxCallTimes are kept
}

// maxCallTimes bounds the arrival times kept per method.
const maxCallTimes = 1000

// inc records a call and returns its 1-based index for the method and overall.
func (c *callCounter) inc(method string) (n, total int64) {
	now := time.Now()
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.byName == nil {
		c.byName, c.times = map[string]int64{}, map[string][]time.Time{}
	}
	c.byName[method]++
	c.total++
	ts := c.times[method]
	if len(ts) >= 2*maxCallTimes {
		// Trimmed in bulk, so that recording stays O(1) amortized.
		ts = append(make([]time.Time, 0, 2*maxCallTimes), ts[len(ts)-maxCallTimes+1:]...)
	}
	c.times[method] = append(ts, now)
	return c.byName[method], c.total
}

// arrivals returns when the last (at most maxCallTimes) calls of method
// arrived, oldest first.
func (c *callCounter) arrivals(method string) []time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	ts := c.times[method]
	if len(ts) > maxCallTimes {
		ts = ts[len(ts)-maxCallTimes:]
	}
	return append([]time.Time(nil), ts...)
}

func (c *callCounter) snapshot() map[string]int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make(map[string]int64, len(c.byName))
	for k, v := range c.byName {
		out[k] = v
	}
	return out
}

func (c *callCounter) get(method string) int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.byName[method]
}

// injector applies Faults to calls.
type injector struct {
	faults Faults
	exit   func(int)
	mu     sync.Mutex // guards rng
	rng    *rand.Rand
}

func newInjector(f Faults) *injector {
	seed := f.Seed
	if seed == 0 {
		seed = rand.Uint64()
	}
	exit := f.Exit
	if exit == nil {
		exit = os.Exit
	}
	return &injector{faults: f, exit: exit, rng: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))}
}

func (in *injector) lookup(method string) (Fault, bool) {
	if f, ok := in.faults.Methods[method]; ok {
		return f, true
	}
	f, ok := in.faults.Methods[AllMethods]
	return f, ok
}

func (in *injector) shouldFail(f Fault, n int64) bool {
	if f.First > 0 && n <= f.First {
		return true
	}
	if f.Rate <= 0 {
		return false
	}
	if f.Rate >= 1 {
		return true
	}
	in.mu.Lock()
	defer in.mu.Unlock()
	return in.rng.Float64() < f.Rate
}

// faultInterceptor counts calls and injects the configured faults.
func (d *Driver) faultInterceptor(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	method := shortMethod(info.FullMethod)
	n, total := d.calls.inc(method)
	f, ok := d.inj.lookup(method)
	if ok && f.Latency > 0 {
		t := time.NewTimer(f.Latency)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return nil, status.FromContextError(ctx.Err()).Err()
		}
	}
	fail := ok && d.inj.shouldFail(f, n)
	injected := func() error {
		code := f.Code
		if code == codes.OK {
			code = codes.Unavailable
		}
		return status.Errorf(code, "sample driver: injected fault in %s (call %d)", method, n)
	}
	if fail && !f.After {
		return nil, injected()
	}
	resp, err := handler(ctx, req)
	if fail {
		resp, err = nil, injected()
	}
	if (ok && f.ExitAfter > 0 && n == f.ExitAfter) || (d.inj.faults.ExitAfter > 0 && total == d.inj.faults.ExitAfter) {
		d.log.Warn("exiting by fault injection", "method", method, "call", n, "total_calls", total, "exit_code", FaultExitCode)
		d.inj.exit(FaultExitCode)
		return nil, status.Errorf(codes.Unavailable, "sample driver: exited by fault injection after %s call %d", method, n)
	}
	return resp, err
}
