package hexgenflow

import (
	"context"
	"fmt"
	"io"
	"sync"

	pb "github.com/hexgen-flow/hexgen-flow/clients/go/hexgenflowv1"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
)

// Events is a stream of a query's events (Watch, Run) or of one call's (RunCall). Read it
// with Next until io.EOF, which comes right after the terminal event; Close it when done
// early (it is closed by itself at the end, or on an error). One goroutine reads it (Next,
// All, Each or Chan); Close and Err may be called from any.
type Events struct {
	parent  context.Context // the caller's
	closed  chan struct{}   // closed by Close
	once    sync.Once
	ctx     context.Context // the stream's: cancelled when it ends
	cancel  context.CancelFunc
	recv    func() (*pb.QueryEvent, error)
	trailer func() metadata.MD
	isEnd   func(*pb.QueryEvent) bool

	pending *pb.QueryEvent // read ahead by the constructor
	last    *pb.QueryEvent

	mu  sync.Mutex
	err error // sticky: io.EOF after the terminal event, or the stream's error
}

// newEvents reads the first event right away, so that a refusal (NOT_FOUND, a bad
// request) is the error of the call that opened the stream (as is a stream that ends
// without any event: a session call whose query had ended).
func newEvents(
	parent, ctx context.Context, cancel context.CancelFunc, recv func() (*pb.QueryEvent, error),
	trailer func() metadata.MD, isEnd func(*pb.QueryEvent) bool,
) (*Events, error) {
	e := &Events{parent: parent, closed: make(chan struct{}), ctx: ctx, cancel: cancel, recv: recv, trailer: trailer, isEnd: isEnd}
	first, err := e.receive()
	if err != nil {
		return nil, err
	}
	e.pending = first
	return e, nil
}

func (e *Events) receive() (*pb.QueryEvent, error) {
	if err := e.ended(); err != nil {
		return nil, err
	}
	ev, err := e.recv()
	if err == io.EOF {
		// The server ended the stream before a terminal event: the query ended otherwise
		// (a session call whose query had ended) or the watcher fell too far behind.
		return nil, e.finish(fmt.Errorf("hexgenflow: the stream ended before its last event: %w", io.ErrUnexpectedEOF))
	}
	if err != nil {
		return nil, e.finish(wrap(e.parent, err, e.trailer()))
	}
	return ev, nil
}

// finish ends the stream with err unless it ended already, and returns the error it
// ended with.
func (e *Events) finish(err error) error {
	e.mu.Lock()
	if e.err == nil {
		e.err = err
	}
	err = e.err
	e.mu.Unlock()
	e.cancel()
	return err
}

func (e *Events) ended() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.err
}

// Next returns the next event; io.EOF after the terminal one (Last returns it), an
// *Error when the stream failed (CANCELED or DEADLINE_EXCEEDED when the context ended),
// or an error wrapping io.ErrUnexpectedEOF when the coordinator ended the stream first.
func (e *Events) Next() (*pb.QueryEvent, error) {
	if err := e.ended(); err != nil {
		return nil, err
	}
	var ev *pb.QueryEvent
	if e.pending != nil {
		ev, e.pending = e.pending, nil
	} else {
		var err error
		if ev, err = e.receive(); err != nil {
			return nil, err
		}
	}
	e.last = ev
	if e.isEnd(ev) {
		e.finish(io.EOF)
	}
	return ev, nil
}

// Last is the latest event Next returned: after io.EOF, the terminal one.
func (e *Events) Last() *pb.QueryEvent { return e.last }

// All reads the rest of the stream to its terminal event.
func (e *Events) All() ([]*pb.QueryEvent, error) {
	var out []*pb.QueryEvent
	for {
		ev, err := e.Next()
		if err == io.EOF {
			return out, nil
		}
		if err != nil {
			return out, err
		}
		out = append(out, ev)
	}
}

// Each calls fn with every event up to the terminal one; an error from fn stops it (the
// stream is closed) and is returned.
func (e *Events) Each(fn func(*pb.QueryEvent) error) error {
	for {
		ev, err := e.Next()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
		if err := fn(ev); err != nil {
			e.Close()
			return err
		}
	}
}

// Chan delivers the events on a channel, closed after the terminal event; the stream's
// error, if any, is then Err's. Stop early with Close (or by cancelling the context).
func (e *Events) Chan() <-chan *pb.QueryEvent {
	ch := make(chan *pb.QueryEvent)
	go func() {
		defer close(ch)
		for {
			ev, err := e.Next()
			if err != nil {
				return
			}
			select {
			case ch <- ev:
			case <-e.closed:
				return
			case <-e.parent.Done():
				e.finish(wrap(e.parent, e.parent.Err(), nil))
				return
			}
		}
	}()
	return ch
}

// Err is the stream's error once it ended: nil after its terminal event.
func (e *Events) Err() error {
	if err := e.ended(); err != io.EOF {
		return err
	}
	return nil
}

// Close ends the stream (the call is cancelled); Next then returns a CANCELED *Error.
// Closing an ended stream does nothing.
func (e *Events) Close() {
	e.once.Do(func() { close(e.closed) })
	e.finish(&Error{Code: codes.Canceled, Message: "the stream was closed", cause: context.Canceled})
}

func isQueryEnd(ev *pb.QueryEvent) bool {
	switch ev.GetKind() {
	case pb.QueryEventKind_QUERY_EVENT_KIND_SUCCEEDED,
		pb.QueryEventKind_QUERY_EVENT_KIND_CANCELLED,
		pb.QueryEventKind_QUERY_EVENT_KIND_FAILED:
		return true
	}
	return false
}

// Terminal reports whether ev ends its query (SUCCEEDED, CANCELLED or FAILED).
func Terminal(ev *pb.QueryEvent) bool { return isQueryEnd(ev) }
