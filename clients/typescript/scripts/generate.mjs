#!/usr/bin/env node
// Generates src/gen/ from ../../protos (the coordinator's API and what it imports) with
// buf (the @bufbuild/buf npm package, a pinned binary) and ts-proto as a local plugin:
// no network, no protoc on PATH. Both versions come from package-lock.json, so the output
// is reproducible after `npm ci`.
//
//   node scripts/generate.mjs           rewrite src/gen/
//   node scripts/generate.mjs --check   exit 1 when src/gen/ differs from a fresh generation
import { spawnSync } from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";

const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..");
const protos = path.resolve(root, "../../protos");
const genDir = path.join(root, "src", "gen");
// The entry points; buf adds the files they import (workflow.proto).
const entries = ["hexgen_flow/v1/coordinator.proto"];
const check = process.argv.includes("--check");

const bin = (name) =>
  path.join(root, "node_modules", ".bin", process.platform === "win32" ? `${name}.cmd` : name);
for (const name of ["buf", "protoc-gen-ts_proto"]) {
  if (!fs.existsSync(bin(name))) {
    console.error(`generate: ${bin(name)} is missing; run \`npm ci\` first`);
    process.exit(2);
  }
}

const tmp = fs.mkdtempSync(path.join(os.tmpdir(), "hexgen-ts-gen-"));
try {
  const args = ["generate", protos, "--template", path.join(root, "buf.gen.yaml"), "-o", tmp];
  for (const entry of entries) args.push("--path", path.join(protos, entry));
  const result = spawnSync(bin("buf"), args, { cwd: root, stdio: "inherit" });
  if (result.error) throw result.error;
  if (result.status !== 0) {
    console.error(`generate: buf exited with ${result.status}`);
    process.exit(2);
  }
  const fresh = listFiles(tmp);
  if (check) {
    const committed = fs.existsSync(genDir) ? listFiles(genDir) : new Map();
    const stale = [];
    for (const [rel, content] of fresh) {
      if (!committed.has(rel)) stale.push(`missing: src/gen/${rel}`);
      else if (!committed.get(rel).equals(content)) stale.push(`differs: src/gen/${rel}`);
    }
    for (const rel of committed.keys()) if (!fresh.has(rel)) stale.push(`extra: src/gen/${rel}`);
    if (stale.length > 0) {
      console.error("generate:check: src/gen/ is stale; run `npm run generate` and commit it");
      for (const line of stale) console.error(`  ${line}`);
      process.exit(1);
    }
    console.log(`generate:check: src/gen/ is up to date (${fresh.size} files)`);
  } else {
    fs.rmSync(genDir, { recursive: true, force: true });
    for (const [rel, content] of fresh) {
      const target = path.join(genDir, rel);
      fs.mkdirSync(path.dirname(target), { recursive: true });
      fs.writeFileSync(target, content);
    }
    console.log(`generate: wrote ${fresh.size} files to src/gen/`);
  }
} finally {
  fs.rmSync(tmp, { recursive: true, force: true });
}

/** Every file under `dir`, keyed by its path relative to `dir` (with forward slashes). */
function listFiles(dir) {
  const files = new Map();
  const walk = (current) => {
    for (const entry of fs.readdirSync(current, { withFileTypes: true })) {
      const full = path.join(current, entry.name);
      if (entry.isDirectory()) walk(full);
      else files.set(path.relative(dir, full).split(path.sep).join("/"), fs.readFileSync(full));
    }
  };
  walk(dir);
  return new Map([...files.entries()].sort(([a], [b]) => (a < b ? -1 : 1)));
}
