package hexgenflow

import (
	"context"
	"time"

	pb "github.com/hexgen-flow/hexgen-flow/clients/go/hexgenflowv1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
)

// Session opens a workflow session: a query whose calls the client gives one at a time,
// as the agent learns them (docs/mesh.md, "Workflow sessions").
type Session struct {
	// ID is the workflow's id (its query id) and the idempotency key.
	ID string
	// Tenant; empty means "default".
	Tenant string
	// SLOSeconds is the end-to-end SLO on the cluster clock; 0 means SLOScale x SLO_base.
	SLOSeconds float64
	// SLOScale is a multiple of SLO_base; 0 means the coordinator's default scale.
	SLOScale float64
	// Template names the stages the workflow expects ("chess", "single"), or Expected
	// gives them (calls with token sizes, no prompts): exactly one of the two.
	Template string
	Expected *pb.Workflow
	// IdleTimeout closes the session after that long without a new call (wall time; 0:
	// the coordinator's default).
	IdleTimeout time.Duration
}

// OpenWorkflow opens a workflow session (OpenWorkflow). Opening a known id with the same
// content returns it (Created false); with other content is ALREADY_EXISTS.
func (c *Client) OpenWorkflow(ctx context.Context, s Session) (*pb.OpenWorkflowResponse, error) {
	request := &pb.OpenWorkflowRequest{
		WorkflowId: s.ID, Tenant: s.Tenant, SloS: s.SLOSeconds, SloScale: s.SLOScale,
		Template: s.Template, Expected: s.Expected, IdleTimeoutS: s.IdleTimeout.Seconds(),
	}
	var resp *pb.OpenWorkflowResponse
	err := c.unary(ctx, s.ID, func(rpc pb.CoordinatorServiceClient, opts ...grpc.CallOption) (err error) {
		resp, err = rpc.OpenWorkflow(ctx, request, opts...)
		return err
	})
	return resp, err
}

// Call is one LLM call of a workflow session.
type Call struct {
	// Prompt is what a real engine generates from (a chat request's plain rendering when
	// Messages are given).
	Prompt string
	// Messages is a chat request; engines with the model's chat template apply it.
	Messages []*pb.ChatMessage
	// Step type; empty means the stage's.
	Step string
	// InputTokens is the prompt's length in tokens; 0: estimated from the prompt.
	InputTokens int32
	// MaxTokens is the most tokens to generate; 0: the expected call's.
	MaxTokens int32
}

// CallEvents is the stream of one RunCall: its events up to the call's CALL_FINISHED
// (or the query's end), after which Next returns io.EOF.
type CallEvents struct {
	*Events
	// CallID is the call's id (e.g. "q-42/2.1").
	CallID string
	// DeadlineS is the call's stage deadline on the cluster clock.
	DeadlineS float64
}

// Text is the generated text, once Next has returned the call's CALL_FINISHED.
func (c *CallEvents) Text() string {
	if last := c.Last(); last.GetKind() == pb.QueryEventKind_QUERY_EVENT_KIND_CALL_FINISHED {
		return last.GetText()
	}
	return ""
}

// RunCall gives one call of an open session's stage (RunCall) and streams its events.
// The stage is its name in the expected workflow (or its step); a name the workflow does
// not expect adds a stage at its end. Refusals (NOT_FOUND for an unknown workflow,
// FAILED_PRECONDITION for a closed or ended one, INVALID_ARGUMENT) are RunCall's error.
func (c *Client) RunCall(parent context.Context, workflowID, stage string, call Call) (*CallEvents, error) {
	request := &pb.RunCallRequest{
		WorkflowId: workflowID,
		Stage:      stage,
		Call: &pb.LLMCall{
			Step: call.Step, InputTokens: call.InputTokens, OutputTokens: call.MaxTokens,
			Prompt: call.Prompt, Messages: call.Messages,
		},
	}
	out := &CallEvents{}
	open := func(ctx context.Context, rpc pb.CoordinatorServiceClient) (func() (*pb.QueryEvent, error), func() metadata.MD, error) {
		stream, err := rpc.RunCall(ctx, request)
		if err != nil {
			return nil, nil, err
		}
		recv := func() (*pb.QueryEvent, error) {
			r, err := stream.Recv()
			if err == nil && r.GetCallId() != "" && out.CallID == "" {
				out.CallID, out.DeadlineS = r.GetCallId(), r.GetDeadlineS()
			}
			return r.GetEvent(), err
		}
		return recv, stream.Trailer, nil
	}
	isEnd := func(ev *pb.QueryEvent) bool {
		if ev.GetKind() == pb.QueryEventKind_QUERY_EVENT_KIND_CALL_FINISHED {
			return out.CallID == "" || ev.GetCallId() == out.CallID
		}
		return isQueryEnd(ev)
	}
	events, err := c.events(parent, workflowID, open, isEnd)
	if err != nil {
		return nil, err
	}
	out.Events = events
	return out, nil
}

// CloseWorkflow closes a session (CloseWorkflow): the calls it expected and was not given
// are skipped, and it succeeds when its last given call finishes.
func (c *Client) CloseWorkflow(ctx context.Context, workflowID string) (*pb.QueryInfo, error) {
	var resp *pb.CloseWorkflowResponse
	err := c.unary(ctx, workflowID, func(rpc pb.CoordinatorServiceClient, opts ...grpc.CallOption) (err error) {
		resp, err = rpc.CloseWorkflow(ctx, &pb.CloseWorkflowRequest{WorkflowId: workflowID}, opts...)
		return err
	})
	if err != nil {
		return nil, err
	}
	return resp.GetWorkflow(), nil
}
