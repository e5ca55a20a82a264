// A durable JetStream consumer on isolator.health.> that validates every event against the published
// JSON Schema of its CloudEvents type and prints the verifier's verdicts. Stop it with Ctrl-C or SIGTERM.
//
//   NATS_URL    NATS server (default nats://127.0.0.1:4222)
//   DURABLE     consumer name; a restart resumes after the last acked event (default verdict-printer-node)
//   SCHEMA_DIR  the published schemas, docs/events/schemas (default: found from this file)
import { readdirSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { Ajv2020, type ValidateFunction } from "ajv/dist/2020.js";
import addFormatsPlugin from "ajv-formats";
import { AckPolicy, DeliverPolicy, connect, type JsMsg } from "nats";

const STREAM = "ISOLATOR";
const SUBJECT = "isolator.health.>";
const VERDICT_TYPE = /^io\.kai-isolator\.health\.verdict\.v\d+$/;

const natsUrl = process.env.NATS_URL ?? "nats://127.0.0.1:4222";
const durable = process.env.DURABLE ?? "verdict-printer-node";
const schemaDir = process.env.SCHEMA_DIR ?? fileURLToPath(new URL("../../../schemas/", import.meta.url));

interface Reason { code: string; message?: string }
interface HealthVerdict {
  pod: { namespace: string; name: string; uid?: string };
  container: string;
  verdict: string;
  reasons?: Reason[];
}
interface CloudEvent { id: string; type: string; subject?: string; data: unknown }

// One validator per event type, keyed by the schema's file name (`<type>.json`).
function loadValidators(dir: string): Map<string, ValidateFunction> {
  const ajv = new Ajv2020({ strict: true, allErrors: true });
  // ajv-formats is CommonJS: under ESM its plugin is the module itself or its `default`.
  const addFormats = ((addFormatsPlugin as unknown as { default?: unknown }).default ?? addFormatsPlugin) as (a: Ajv2020) => void;
  addFormats(ajv);
  const validators = new Map<string, ValidateFunction>();
  for (const file of readdirSync(dir).filter((f) => f.endsWith(".json"))) {
    validators.set(file.slice(0, -".json".length), ajv.compile(JSON.parse(readFileSync(join(dir, file), "utf8"))));
  }
  if (validators.size === 0) throw new Error(`no schemas in ${dir}`);
  return validators;
}

function handle(msg: JsMsg, validators: Map<string, ValidateFunction>): void {
  let event: CloudEvent;
  try {
    event = JSON.parse(new TextDecoder().decode(msg.data)) as CloudEvent;
  } catch (error) {
    console.log(`invalid seq=${msg.seq} subject=${msg.subject}: not JSON (${(error as Error).message})`);
    msg.term();
    return;
  }
  const type: unknown = event?.type;
  const validate = typeof type === "string" ? validators.get(type) : undefined;
  if (validate === undefined) {
    // A type newer than our schemas: the contract only ever adds types, so skip it rather than fail.
    console.log(`skipped seq=${msg.seq} subject=${msg.subject}: no published schema for type ${JSON.stringify(type ?? null)}`);
    msg.ack();
    return;
  }
  if (!validate(event)) {
    const errors = (validate.errors ?? []).map((e) => `${e.instancePath || "/"} ${e.message} ${JSON.stringify(e.params)}`).join("; ");
    console.log(`invalid seq=${msg.seq} subject=${msg.subject} type=${String(type)}: ${errors}`);
    msg.term(); // redelivering a message that does not match its schema would not make it match
    return;
  }
  if (VERDICT_TYPE.test(event.type)) {
    const v = event.data as HealthVerdict;
    const reasons = (v.reasons ?? []).map((r) => r.code).join(",") || "-";
    console.log(`valid id=${event.id} type=${event.type} pod=${v.pod.namespace}/${v.pod.name} container=${v.container} verdict=${v.verdict} reasons=${reasons}`);
  } else {
    console.log(`valid id=${event.id} type=${event.type} subject=${event.subject ?? msg.subject}`);
  }
  msg.ack();
}

async function main(): Promise<void> {
  const validators = loadValidators(schemaDir);
  const nc = await connect({ servers: natsUrl.split(","), name: durable, maxReconnectAttempts: -1 }).catch((error: Error) => {
    throw new Error(`cannot connect to NATS at ${natsUrl}: ${error.message}`);
  });
  const jsm = await nc.jetstreamManager();
  try {
    // Creating a durable that already exists with this configuration just binds to it.
    await jsm.consumers.add(STREAM, {
      durable_name: durable,
      filter_subject: SUBJECT,
      ack_policy: AckPolicy.Explicit,
      deliver_policy: DeliverPolicy.All,
    });
  } catch (error) {
    throw new Error(`cannot create consumer ${durable} on stream ${STREAM} (is the isolator running?): ${(error as Error).message}`);
  }
  const consumer = await nc.jetstream().consumers.get(STREAM, durable);
  const messages = await consumer.consume();
  const stop = (): void => {
    messages.stop();
  };
  process.once("SIGTERM", stop);
  process.once("SIGINT", stop);
  console.log(`ready: durable ${durable} on stream ${STREAM}, filter ${SUBJECT}, ${validators.size} schemas from ${schemaDir}`);
  for await (const msg of messages) {
    handle(msg, validators);
  }
  await nc.drain();
  console.log("stopped");
}

main().catch((error: unknown) => {
  console.error(`verdict subscriber: ${(error as Error).message}`);
  process.exit(1);
});
