package broker

import (
	"errors"

	"google.golang.org/grpc/status"
)

// callError is a call's gRPC status with what the broker knows of where
// it came from. It is a status error like any other (status.Code and
// status.Convert read it); the flags are for callers that read a failure
// as a statement about the driver's state. Secret redaction keeps them.
type callError struct {
	st *status.Status
	// answered: the call's answer carried the status (the driver's, passed
	// on unchanged, or the proxy's when the driver was out of its reach),
	// not the broker itself (its message limits, a lost or reset
	// connection, a malformed answer, a deadline).
	answered bool
	// retried: the broker retried the call after an attempt that ended
	// Unavailable. That attempt may have reached the driver and acted
	// (made a volume, say) although it answered no success, so a caller
	// that forgets what it asked for on a final error (the intent of a
	// CreateVolume) must not. The status is the last attempt's.
	retried bool
}

func (e *callError) Error() string              { return e.st.Err().Error() }
func (e *callError) GRPCStatus() *status.Status { return e.st }

// Answered reports whether err is a status that a call's answer carried
// (the driver's, or the proxy's when it could not reach the driver), not
// one the broker made itself. A caller that reads a driver's answer as a
// statement about the driver's state (recovery takes "no room" to mean "no
// such volume") asks this first. Any error in err's chain with an Answered
// method that says so counts, so a caller's unit test can stand in for a
// driver's answer.
func Answered(err error) bool {
	var e interface{ Answered() bool }
	return errors.As(err, &e) && e.Answered()
}

func (e *callError) Answered() bool { return e.answered }

// EarlierAttemptUnavailable reports whether err ends a call the broker
// retried after an attempt that ended Unavailable: the driver may have
// acted on the call whatever the final status says. Any error in err's
// chain with an EarlierAttemptUnavailable method that says so counts, so
// a caller's unit test can stand in for the broker.
func EarlierAttemptUnavailable(err error) bool {
	var e interface{ EarlierAttemptUnavailable() bool }
	return errors.As(err, &e) && e.EarlierAttemptUnavailable()
}

func (e *callError) EarlierAttemptUnavailable() bool { return e.retried }
