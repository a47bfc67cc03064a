// Runs a small three-stage workflow, then a workflow session of two calls, printing events.
//
//   npm run build
//   node dist/examples/run.js 127.0.0.1:50051      (or HEXGEN_COORDINATOR=...)
//
// A secured mesh (`hexgen-flow up --secure`): the client reads the CA file and the API key
// from HEXGEN_FLOW_TLS_CA and HEXGEN_FLOW_API_KEY (README.md, "A secured mesh").
//
// The package imports itself by name (package.json "exports"), as an application would.
import {
  CoordinatorClient,
  CoordinatorError,
  DEFAULT_COORDINATOR,
  eventKindName,
  type QueryEvent,
} from "@hexgen-flow/client";

const address = process.argv[2] ?? process.env["HEXGEN_COORDINATOR"] ?? DEFAULT_COORDINATOR;
const suffix = `${Date.now().toString(36)}-${process.pid}`;

function show(event: QueryEvent): void {
  const parts = [`  ${event.timeS.toFixed(2).padStart(8)}s`, eventKindName(event.kind).padEnd(18)];
  if (event.stage >= 0) parts.push(`stage ${event.stage}`);
  if (event.callId) parts.push(event.callId);
  if (event.instance) parts.push(`on ${event.instance}`);
  if (event.text) parts.push(JSON.stringify(event.text.slice(0, 60)));
  console.log(parts.join("  "));
}

async function main(): Promise<void> {
  const client = new CoordinatorClient(address);
  try {
    const status = await client.status();
    console.log(
      `coordinator ${address}: cluster ${status.cluster}, policy ${status.policy}, ` +
        `alpha ${status.alpha}, time scale ${status.timeScale}`,
    );

    // 1. A static workflow: one call, a fan-out of two, one call; RunQuery streams its events.
    const queryId = `ts-example-${suffix}`;
    console.log(`\nrun ${queryId}`);
    const workflow = {
      stages: [
        { id: "plan", step: "extract_keywords", calls: [{ inputTokens: 400, outputTokens: 32 }] },
        {
          id: "draft",
          step: "generate_candidate",
          after: ["plan"],
          calls: [
            { inputTokens: 900, outputTokens: 96 },
            { inputTokens: 900, outputTokens: 96 },
          ],
        },
        { id: "pick", step: "evaluate", after: ["draft"], calls: [{ inputTokens: 600, outputTokens: 16 }] },
      ],
    };
    for await (const event of client.run({ queryId, workflow })) show(event);
    const info = (await client.get(queryId)).query;
    if (info) console.log(`  end to end: ${(info.finishedS - info.arrivalS).toFixed(2)} s (SLO ${info.sloS.toFixed(1)} s)`);

    // 2. A workflow session: the calls are given as the agent learns them.
    const workflowId = `ts-session-${suffix}`;
    console.log(`\nsession ${workflowId} (template chess)`);
    await client.openWorkflow({ workflowId, template: "chess", sloScale: 2 });
    let keywords = "";
    for await (const response of client.runCall(workflowId, "extract_keywords", {
      prompt: "Which players won more than ten games in 2024?",
      outputTokens: 32,
    })) {
      if (response.callId) console.log(`  call ${response.callId}, stage deadline ${response.deadlineS.toFixed(2)} s`);
      if (response.event) {
        show(response.event);
        if (eventKindName(response.event.kind) === "CALL_FINISHED") keywords = response.event.text;
      }
    }
    for await (const response of client.runCall(workflowId, "information_retriever", {
      messages: [
        { role: "system", content: "Link the question to the schema." },
        { role: "user", content: `keywords: ${keywords}` },
      ],
      outputTokens: 64,
    })) {
      if (response.callId) console.log(`  call ${response.callId}, stage deadline ${response.deadlineS.toFixed(2)} s`);
      if (response.event) show(response.event);
    }
    await client.closeWorkflow(workflowId);
    for await (const event of client.watch(workflowId)) {
      if (eventKindName(event.kind) === "SUCCEEDED") show(event);
    }
    const session = await client.get(workflowId);
    for (const stage of session.stages) {
      console.log(
        `  stage ${stage.index} ${stage.name.padEnd(22)} given ${stage.callsGiven}, ` +
          `done ${stage.callsDone}/${stage.callsTotal}, skipped ${stage.callsSkipped}`,
      );
    }
  } finally {
    client.close();
  }
}

main().catch((error: unknown) => {
  if (error instanceof CoordinatorError) console.error(`error: ${error.message}`);
  else console.error(error);
  process.exit(1);
});
