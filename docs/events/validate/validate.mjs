// Validates an AsyncAPI document with @asyncapi/parser: exit 0 when it parses with no error or warning, 1 otherwise.
import { readFile } from "node:fs/promises";
import { resolve } from "node:path";
import { Parser } from "@asyncapi/parser";

const SEVERITY = ["error", "warning", "info", "hint"];

const path = process.argv[2];
if (!path) {
  console.error("usage: node validate.mjs ASYNCAPI.yaml");
  process.exit(2);
}
const source = resolve(path);
const text = await readFile(source, "utf8");
const { document, diagnostics } = await new Parser().parse(text, { source });
const problems = diagnostics.filter((d) => d.severity <= 1);
for (const d of diagnostics) {
  const where = d.path.length ? d.path.join(".") : "(document)";
  console.log(`${SEVERITY[d.severity]} ${d.code} at ${where}: ${d.message}`);
}
if (document === undefined || problems.length > 0) {
  console.log(`${source}: INVALID (${problems.length} error(s) or warning(s))`);
  process.exit(1);
}
console.log(`${source}: valid AsyncAPI ${document.version()}: ${document.channels().length} channels, ${document.operations().length} operations, ${document.messages().length} messages`);
