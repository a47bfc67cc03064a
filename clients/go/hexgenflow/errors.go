package hexgenflow

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// RetryAfterTrailer is the trailing metadata of a RESOURCE_EXHAUSTED answer: wall seconds
// until a retry may be admitted (a decimal number).
const RetryAfterTrailer = "retry-after-s"

// Error is every error the coordinator answers (and every transport failure, as
// UNAVAILABLE): its gRPC code, its message and, for a refusal by admission control, the
// retry-after hint. Match a kind with errors.Is(err, ErrNotFound) and the like, or read
// the code with Code(err).
type Error struct {
	// Code is the gRPC status code (codes.InvalidArgument, codes.NotFound, ...).
	Code codes.Code
	// Message is the coordinator's one-line message. For INVALID_ARGUMENT,
	// ALREADY_EXISTS and NOT_FOUND it starts with the field it is about
	// ("workflow.stages[0].calls[0].output_tokens: must be positive"); see Field.
	Message string
	// RetryAfter is the coordinator's hint for a RESOURCE_EXHAUSTED answer (its
	// retry-after-s trailer); 0 when it sent none.
	RetryAfter time.Duration
	// Address is the coordinator that answered (or did not): with several, the one the
	// call ended at, or every address tried, comma-separated, when none could serve.
	Address string

	status   *status.Status
	cause    error
	owner    string // a redirect's owner (its ShardOwnerTrailer)
	answered bool   // UNAVAILABLE said by the coordinator itself (it runs), not a connection that failed
}

// Error renders the code as the API names it: "hexgenflow: NOT_FOUND: query_id: no query 'x'".
func (e *Error) Error() string {
	return fmt.Sprintf("hexgenflow: %s: %s", CodeName(e.Code), e.Message)
}

// Field is the request field the message names ("query_id", "workflow.stages[2].id"),
// the text before the first ": " of an INVALID_ARGUMENT, ALREADY_EXISTS or NOT_FOUND
// message; empty for other codes or a message without one.
func (e *Error) Field() string {
	switch e.Code {
	case codes.InvalidArgument, codes.AlreadyExists, codes.NotFound:
	default:
		return ""
	}
	field, _, ok := strings.Cut(e.Message, ": ")
	if !ok || strings.ContainsAny(field, " \t") {
		return ""
	}
	return field
}

// Retryable reports whether the same request may succeed later unchanged: UNAVAILABLE
// (Redis or the coordinator away) and RESOURCE_EXHAUSTED (after RetryAfter).
func (e *Error) Retryable() bool {
	return e.Code == codes.Unavailable || e.Code == codes.ResourceExhausted
}

// unavailable reports whether the coordinator could not serve the call: UNAVAILABLE, or
// CANCELLED that the caller did not cause (the coordinator cancelled its calls as it
// stopped: a restart, a shard handed over). Routing moves on to another address then.
func (e *Error) unavailable() bool {
	return e.Code == codes.Unavailable || (e.Code == codes.Canceled && e.cause == nil)
}

// GRPCStatus lets status.FromError and status.Code see the original status.
func (e *Error) GRPCStatus() *status.Status {
	if e.status != nil {
		return e.status
	}
	return status.New(e.Code, e.Message)
}

// Unwrap gives the caller's context error when the call ended because its context was
// cancelled or ran out, so errors.Is(err, context.Canceled) holds then.
func (e *Error) Unwrap() error { return e.cause }

// Is matches the sentinels (ErrNotFound, ...) by code.
func (e *Error) Is(target error) bool {
	var s *sentinel
	if errors.As(target, &s) {
		return s.code == e.Code
	}
	return false
}

type sentinel struct {
	code codes.Code
}

func (s *sentinel) Error() string { return "hexgenflow: " + CodeName(s.code) }

// Sentinels for errors.Is: errors.Is(err, hexgenflow.ErrNotFound) holds for any *Error
// with that code.
var (
	// ErrInvalidArgument: a bad request; the message names the field.
	ErrInvalidArgument error = &sentinel{codes.InvalidArgument}
	// ErrNotFound: an unknown query or workflow id.
	ErrNotFound error = &sentinel{codes.NotFound}
	// ErrAlreadyExists: an id submitted again with other content.
	ErrAlreadyExists error = &sentinel{codes.AlreadyExists}
	// ErrResourceExhausted: refused by admission control or a limit; retry after
	// (*Error).RetryAfter.
	ErrResourceExhausted error = &sentinel{codes.ResourceExhausted}
	// ErrFailedPrecondition: the request is valid but the state it acts on does not allow
	// it now (a call for a closed or ended workflow session).
	ErrFailedPrecondition error = &sentinel{codes.FailedPrecondition}
	// ErrUnavailable: the coordinator (or its Redis) cannot be reached now; retryable.
	ErrUnavailable error = &sentinel{codes.Unavailable}
	// ErrUnauthenticated: a secured coordinator got no API key, or one it does not know
	// (or a revoked or expired one).
	ErrUnauthenticated error = &sentinel{codes.Unauthenticated}
	// ErrPermissionDenied: the API key's role may not do this (SetAlpha needs an operator
	// or admin key).
	ErrPermissionDenied error = &sentinel{codes.PermissionDenied}
	// ErrShardRedirectLoop: coordinators redirected a query's call in a circle, or further
	// than MaxRedirects (a *ShardRedirectLoopError).
	ErrShardRedirectLoop = errors.New("hexgenflow: the coordinators keep redirecting the query")
)

// ShardRedirectLoopError is what a call returns when coordinators redirected its query in
// a circle, or further than MaxRedirects: they disagree on who owns its shard (not the same
// --shards, or a stale lease). errors.Is(err, ErrShardRedirectLoop) holds; it unwraps to
// the last redirect's *Error (FAILED_PRECONDITION), so Code(err) and errors.As(err, &e)
// with e an *Error work as for any other error.
type ShardRedirectLoopError struct {
	// QueryID is the query the call was about.
	QueryID string
	// Hops are the addresses the call was sent to, in order, then the owner the last one
	// named.
	Hops []string
	// Last is the last redirect's answer.
	Last *Error
}

// Error names the hops: "hexgenflow: query 'q-1': the coordinators keep redirecting it
// (A -> B -> A); do they all run with the same --shards? Last answer: ...".
func (e *ShardRedirectLoopError) Error() string {
	return fmt.Sprintf("hexgenflow: query '%s': the coordinators keep redirecting it (%s); "+
		"do they all run with the same --shards? Last answer: %s",
		e.QueryID, strings.Join(e.Hops, " -> "), e.Last.Message)
}

// Unwrap is the last redirect's *Error.
func (e *ShardRedirectLoopError) Unwrap() error { return e.Last }

// Is matches ErrShardRedirectLoop.
func (e *ShardRedirectLoopError) Is(target error) bool { return target == ErrShardRedirectLoop }

// Code is the gRPC code of err: its *Error's, codes.OK for nil, codes.Unknown otherwise.
func Code(err error) codes.Code {
	if err == nil {
		return codes.OK
	}
	var e *Error
	if errors.As(err, &e) {
		return e.Code
	}
	return status.Code(err)
}

// RetryAfter is the retry-after hint carried by err (a RESOURCE_EXHAUSTED *Error), and
// whether it had one.
func RetryAfter(err error) (time.Duration, bool) {
	var e *Error
	if errors.As(err, &e) && e.RetryAfter > 0 {
		return e.RetryAfter, true
	}
	return 0, false
}

// CodeName is the code as the gRPC spec and the API's docs spell it: "NOT_FOUND".
func CodeName(c codes.Code) string {
	name := c.String() // "NotFound"; "Code(42)" for unknown values
	if strings.HasPrefix(name, "Code(") {
		return name
	}
	if c == codes.OK {
		return "OK"
	}
	var b strings.Builder
	for i, r := range name {
		if i > 0 && r >= 'A' && r <= 'Z' {
			b.WriteByte('_')
		}
		b.WriteRune(r)
	}
	return strings.ToUpper(b.String())
}

// deadlineSkew is how far ahead of the caller's deadline a server's DEADLINE_EXCEEDED may
// come (its rounded timeout and the wire): within it, wrap waits for the caller's context.
const deadlineSkew = 100 * time.Millisecond

// wrap turns what a stub returned into an *Error (nil stays nil). trailer is the call's
// trailing metadata, for the retry-after hint.
func wrap(ctx context.Context, err error, trailer metadata.MD) error {
	if err == nil {
		return nil
	}
	var already *Error
	if errors.As(err, &already) {
		return err
	}
	st, ok := status.FromError(err)
	if !ok {
		// Not a status: a context error from a blocking dial or the like.
		code := codes.Unknown
		switch {
		case errors.Is(err, context.Canceled):
			code = codes.Canceled
		case errors.Is(err, context.DeadlineExceeded):
			code = codes.DeadlineExceeded
		}
		return &Error{Code: code, Message: err.Error(), cause: err}
	}
	e := &Error{Code: st.Code(), Message: st.Message(), status: st}
	if ctx != nil && e.Code == codes.DeadlineExceeded && ctx.Err() == nil {
		// The caller's deadline travels as a timeout the server rounds, so the server may
		// report it a moment before the caller's own timer fires: the context is about to
		// end. Wait for it (no longer than the deadline, plus a little) so that the error
		// still says context.DeadlineExceeded, as it does when the caller's timer wins.
		if deadline, ok := ctx.Deadline(); ok && time.Until(deadline) < deadlineSkew {
			timer := time.NewTimer(time.Until(deadline) + 5*time.Millisecond)
			select {
			case <-ctx.Done():
			case <-timer.C:
			}
			timer.Stop()
		}
	}
	if ctx != nil && ctx.Err() != nil && (e.Code == codes.Canceled || e.Code == codes.DeadlineExceeded) {
		e.cause = ctx.Err()
	}
	if e.Code == codes.ResourceExhausted {
		e.RetryAfter = parseRetryAfter(trailer)
	}
	e.owner = ownerIn(e.Code, trailer)
	return e
}

func parseRetryAfter(md metadata.MD) time.Duration {
	values := md.Get(RetryAfterTrailer)
	if len(values) == 0 {
		return 0
	}
	seconds, err := strconv.ParseFloat(strings.TrimSpace(values[0]), 64)
	if err != nil || !(seconds >= 0 && seconds <= 1e6) { // NaN too
		return 0
	}
	return time.Duration(seconds * float64(time.Second))
}
