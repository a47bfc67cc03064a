// Command traced runs one small workflow inside an OpenTelemetry span of its own, so the
// client, the coordinator and the worker that runs its calls share one trace: the wrapper
// injects the W3C traceparent of the span the call's context carries.
//
//	go run ./example/traced -addr 127.0.0.1:50051 -spans /tmp/client-spans.json
//
// The OpenTelemetry Go SDK (Debian's golang-opentelemetry-otel-dev, 1.1.0) exports the
// client's spans with the stdouttrace exporter to the -spans file, one JSON object a line
// (SpanContext.TraceID, SpanContext.SpanID, Name, ...); the last line on stdout is the
// trace id. The coordinator and the workers export theirs over OTLP when they run with
// OTEL_EXPORTER_OTLP_ENDPOINT (docs/mesh.md, "Tracing"); tests/test_client_traces.py
// checks that they all land in the one trace.
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"os"
	"strings"
	"time"

	"github.com/hexgen-flow/hexgen-flow/clients/go/hexgenflow"
	pb "github.com/hexgen-flow/hexgen-flow/clients/go/hexgenflowv1"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/stdout/stdouttrace"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
)

func main() {
	addr := flag.String("addr", envOr("HEXGEN_COORDINATOR", hexgenflow.DefaultAddress), "coordinator host:port")
	spans := flag.String("spans", "client-spans.json", "file the client's spans are written to (JSON, one a line)")
	id := flag.String("id", "go-traced-"+time.Now().Format("150405.000"), "the query id")
	timeout := flag.Duration("timeout", 2*time.Minute, "give up after this long")
	flag.Parse()
	if err := run(*addr, *spans, *id, *timeout); err != nil {
		log.Fatal(err)
	}
}

func run(addr, spansPath, id string, timeout time.Duration) error {
	out, err := os.Create(spansPath)
	if err != nil {
		return err
	}
	defer out.Close()
	exporter, err := stdouttrace.New(stdouttrace.WithWriter(out))
	if err != nil {
		return err
	}
	provider := sdktrace.NewTracerProvider(
		sdktrace.WithSyncer(exporter), // each span is written when it ends
		sdktrace.WithResource(resource.NewSchemaless(attribute.String("service.name", "hexgen-go-client"))),
	)
	// Shut the provider down however run ends, so the file holds every ended span.
	defer func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := provider.Shutdown(ctx); err != nil {
			log.Printf("shutting the tracer provider down: %v", err)
		}
	}()
	tracer := provider.Tracer("github.com/hexgen-flow/hexgen-flow/clients/go/example/traced")

	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	client, err := hexgenflow.Dial(ctx, addr)
	if err != nil {
		return err
	}
	defer client.Close()

	// The client's span: every call made with ctx carries it as the traceparent.
	ctx, span := tracer.Start(ctx, "client.run_workflow", trace.WithSpanKind(trace.SpanKindClient),
		trace.WithAttributes(attribute.String("hexgen.query.id", id)))
	defer span.End()
	traceID := span.SpanContext().TraceID().String()
	fmt.Printf("trace %s, span %s\n", traceID, span.SpanContext().SpanID())

	call := func(in, out int32) *pb.LLMCall { return &pb.LLMCall{InputTokens: in, OutputTokens: out} }
	resp, err := client.Submit(ctx, hexgenflow.Query{ID: id, SLOScale: 5, Workflow: &pb.Workflow{Stages: []*pb.Stage{
		{Id: "keywords", Step: "extract_keywords", Calls: []*pb.LLMCall{call(300, 16)}},
		{Id: "answer", Step: "evaluate", Calls: []*pb.LLMCall{call(500, 24)}, After: []string{"keywords"}},
	}}})
	if err != nil {
		return fmt.Errorf("SubmitQuery: %w", err)
	}
	fmt.Printf("submitted %s (created %v)\n", id, resp.GetCreated())
	events, err := client.Watch(ctx, id)
	if err != nil {
		return fmt.Errorf("WatchQuery: %w", err)
	}
	defer events.Close()
	err = events.Each(func(ev *pb.QueryEvent) error {
		line := fmt.Sprintf("  %8.2f s  %s", ev.GetTimeS(), strings.TrimPrefix(ev.GetKind().String(), "QUERY_EVENT_KIND_"))
		if ev.GetInstance() != "" {
			line += " on " + ev.GetInstance()
		}
		fmt.Println(line)
		return nil
	})
	if err != nil {
		return fmt.Errorf("WatchQuery: %w", err)
	}
	if k := events.Last().GetKind(); k != pb.QueryEventKind_QUERY_EVENT_KIND_SUCCEEDED {
		return fmt.Errorf("the query ended %v", k)
	}
	span.End()
	fmt.Println(traceID)
	return nil
}

func envOr(key, fallback string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return fallback
}
