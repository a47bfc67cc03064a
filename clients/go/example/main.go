// Command example runs a small workflow and a two-call workflow session against a
// coordinator and prints their events and results.
//
//	go run ./example -addr 127.0.0.1:50051
//	go run ./example -addr 127.0.0.1:50051 -tls-ca AUTH_DIR/ca.pem -api-key-file AUTH_DIR/tenants/a.key
//	go run ./example -addr 127.0.0.1:P0,127.0.0.1:P1   # a sharded mesh's coordinators
//
// (offline, from a GOPATH as clients/go/README.md sets up; -addr defaults to
// $HEXGEN_COORDINATOR, then 127.0.0.1:50051; without -tls-ca and -api-key-file the client
// reads $HEXGEN_FLOW_TLS_CA and $HEXGEN_FLOW_API_KEY, and is plaintext without a key when
// they are unset).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log"
	"os"
	"strings"
	"time"

	"github.com/hexgen-flow/hexgen-flow/clients/go/hexgenflow"
	pb "github.com/hexgen-flow/hexgen-flow/clients/go/hexgenflowv1"
)

func main() {
	addr := flag.String("addr", envOr("HEXGEN_COORDINATOR", hexgenflow.DefaultAddress), "coordinator host:port, or a sharded mesh's comma list host:port,host:port")
	timeout := flag.Duration("timeout", 2*time.Minute, "give up after this long")
	apiKeyFile := flag.String("api-key-file", "", "file holding the API key of a secured coordinator (default: $"+hexgenflow.APIKeyEnv+")")
	tlsCA := flag.String("tls-ca", "", "CA file (PEM) to verify a secured coordinator's certificate with: TLS (default: $"+hexgenflow.TLSCAEnv+"; neither: plaintext)")
	flag.Parse()

	var opts []hexgenflow.Option
	if *apiKeyFile != "" {
		opts = append(opts, hexgenflow.WithAPIKeyFile(*apiKeyFile))
	}
	if *tlsCA != "" {
		opts = append(opts, hexgenflow.WithTLSCA(*tlsCA))
	}
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	client, err := hexgenflow.Dial(ctx, *addr, opts...)
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close()

	status, err := client.Status(ctx)
	if err != nil {
		log.Fatalf("ClusterStatus: %v", err) // UNAVAILABLE when nothing answers at addr
	}
	fmt.Printf("cluster %s: policy %s, alpha %.2f, time scale %g\n",
		status.GetCluster(), status.GetPolicy(), status.GetAlpha(), status.GetTimeScale())

	suffix := time.Now().Format("150405.000")
	if err := runWorkflow(ctx, client, "go-example-"+suffix); err != nil {
		log.Fatal(err)
	}
	if err := runSession(ctx, client, "go-session-"+suffix); err != nil {
		log.Fatal(err)
	}
}

// runWorkflow submits keywords -> two candidates -> evaluate and follows it to its end.
func runWorkflow(ctx context.Context, client *hexgenflow.Client, id string) error {
	call := func(in, out int32) *pb.LLMCall { return &pb.LLMCall{InputTokens: in, OutputTokens: out} }
	workflow := &pb.Workflow{Stages: []*pb.Stage{
		{Id: "keywords", Step: "extract_keywords", Calls: []*pb.LLMCall{call(400, 20)}},
		{Id: "candidates", Step: "generate_candidate", Calls: []*pb.LLMCall{call(800, 60), call(800, 60)}, After: []string{"keywords"}},
		{Id: "evaluate", Step: "evaluate", Calls: []*pb.LLMCall{call(600, 10)}, After: []string{"candidates"}},
	}}
	fmt.Printf("\n== workflow %s\n", id)
	events, err := client.Run(ctx, hexgenflow.Query{ID: id, Workflow: workflow})
	if errors.Is(err, hexgenflow.ErrResourceExhausted) {
		d, _ := hexgenflow.RetryAfter(err)
		return fmt.Errorf("refused by admission control, retry after %v: %w", d, err)
	}
	if err != nil {
		return err
	}
	defer events.Close()
	if err := events.Each(printEvent); err != nil {
		return err
	}
	got, err := client.Get(ctx, id)
	if err != nil {
		return err
	}
	q := got.GetQuery()
	fmt.Printf("result: %s in %.1f s (SLO %.1f s), %d/%d calls\n", shortState(q.GetState()),
		q.GetFinishedS()-q.GetArrivalS(), q.GetSloS(), q.GetCallsDone(), q.GetCallsTotal())
	return nil
}

// runSession opens a session, gives two calls as an agent would, and closes it.
func runSession(ctx context.Context, client *hexgenflow.Client, id string) error {
	fmt.Printf("\n== workflow session %s\n", id)
	if _, err := client.OpenWorkflow(ctx, hexgenflow.Session{ID: id, Template: "single", SLOScale: 5}); err != nil {
		return err
	}
	answer := ""
	for _, step := range []struct{ stage, prompt string }{
		{"chat", "Which tables hold the orders?"},
		{"refine", "Given the answer, write the SQL."}, // not expected: added at the end
	} {
		events, err := client.RunCall(ctx, id, step.stage, hexgenflow.Call{Prompt: step.prompt + answer, MaxTokens: 48})
		if err != nil {
			return err
		}
		fmt.Printf("call %s (stage %q, deadline %.1f s)\n", events.CallID, step.stage, events.DeadlineS)
		if err := events.Each(printEvent); err != nil {
			return err
		}
		answer = " " + events.Text()
	}
	info, err := client.CloseWorkflow(ctx, id)
	if err != nil {
		return err
	}
	events, err := client.Watch(ctx, id) // to its end: it succeeds once its calls are done
	if err != nil {
		return err
	}
	if _, err := events.All(); err != nil {
		return err
	}
	got, err := client.Get(ctx, id)
	if err != nil {
		return err
	}
	fmt.Printf("result: %s (closed: open=%v), stages:", shortState(got.GetQuery().GetState()), info.GetSessionOpen())
	for _, s := range got.GetStages() {
		fmt.Printf(" %s[%d/%d]", s.GetName(), s.GetCallsDone(), s.GetCallsTotal())
	}
	fmt.Println()
	return nil
}

func printEvent(ev *pb.QueryEvent) error {
	kind := strings.TrimPrefix(ev.GetKind().String(), "QUERY_EVENT_KIND_")
	line := fmt.Sprintf("  %8.2f s  %-18s", ev.GetTimeS(), kind)
	if ev.GetCallId() != "" {
		line += " " + ev.GetCallId()
	}
	if ev.GetInstance() != "" {
		line += " on " + ev.GetInstance()
	}
	if ev.GetText() != "" {
		line += fmt.Sprintf(" %q", ev.GetText())
	}
	fmt.Println(strings.TrimRight(line, " "))
	return nil
}

func shortState(s pb.QueryState) string { return strings.TrimPrefix(s.String(), "QUERY_STATE_") }

func envOr(key, fallback string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return fallback
}
