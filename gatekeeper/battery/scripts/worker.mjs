// gatekeeper's JavaScript assertion worker: one request per stdin line, one reply per line on the file
// descriptor named by argv[2] (stdout and stderr are the user's, and go nowhere). A request is
// {code | file + fn, output, context}; a reply is {kind: "boolean"|"number"|"grading", ...} or {error}.
// It reads the result as promptfoo 0.123.1's javascript assertion does (src/assertions/javascript.ts).
import fs from "node:fs";
import { createRequire } from "node:module";
import readline from "node:readline";
import { pathToFileURL } from "node:url";

const replies = Number(process.argv[2]);

// Inline code sees `process` with a working process.mainModule.require, as promptfoo gives it.
const scriptRequire = createRequire(import.meta.url);
const processShim = new Proxy(process, {
  get: (target, prop) => (prop === "mainModule" ? { require: scriptRequire, exports: {} } : Reflect.get(target, prop)),
});

// The last `;` outside string and template literals (a quote after an odd run of backslashes is escaped).
function lastStatementSemicolon(code) {
  let quote = null;
  let last = -1;
  let backslashes = 0;
  for (let i = 0; i < code.length; i++) {
    const c = code[i];
    if (backslashes % 2 === 0 && (c === "'" || c === '"' || c === "`")) {
      if (quote === null) quote = c;
      else if (quote === c) quote = null;
    }
    if (c === ";" && quote === null) last = i;
    backslashes = c === "\\" ? backslashes + 1 : 0;
  }
  return last;
}

// One line of code: an expression to return, or declarations then the expression to return.
function functionBody(code) {
  const text = code.trim().replace(/;+\s*$/, "");
  if (!/^(const|let|var)\s/.test(text)) return `return ${text}`;
  const at = lastStatementSemicolon(text);
  const tail = at === -1 ? "" : text.slice(at + 1).trim();
  return tail ? `${text.slice(0, at + 1)} return ${tail}` : text;
}

function isGradingResult(r) {
  const optional = (v, type) => v === undefined || typeof v === type;
  return typeof r === "object" && r !== null && typeof r.pass === "boolean" && typeof r.score === "number" &&
    typeof r.reason === "string" && optional(r.namedScores, "object") && optional(r.namedScoreWeights, "object") &&
    optional(r.tokensUsed, "object") && (r.componentResults === undefined || Array.isArray(r.componentResults)) &&
    optional(r.assertion, "object") && optional(r.comment, "string");
}

async function fromFile(file, fn, output, context) {
  const ns = await import(pathToFileURL(file).href);
  let mod = ns?.default?.default || ns?.default || ns;
  if (fn) mod = mod[fn];
  if (typeof mod === "function") return mod(output, context);
  if (mod.default && typeof mod.default === "function") return mod.default(output, context);
  throw new Error(`Assertion malformed: ${file} must export a function or have a default export as a function`);
}

async function evaluate({ code, file, fn, output, context }) {
  let result;
  if (file) {
    result = await fromFile(file, fn, output, context);
    if (!["boolean", "number", "object"].includes(typeof result)) {
      throw new Error(`Javascript assertion script must return a boolean, number, or object (file://${file})`);
    }
  } else {
    const text = code.trimEnd();
    const body = text.includes("\n") ? text : functionBody(text);
    result = await new Function("output", "context", "process", body)(output, context, processShim);
  }
  if (typeof result === "boolean") return { kind: "boolean", value: result };
  if (typeof result === "number") return { kind: "number", value: String(result) };  // NaN and Infinity survive
  if (isGradingResult(result)) {
    return { kind: "grading", pass: result.pass, score: String(result.score), reason: result.reason };
  }
  throw new Error(`Custom function must return a boolean, number, or GradingResult object. ` +
    `Got type ${typeof result}: ${JSON.stringify(result)}`);
}

for await (const line of readline.createInterface({ input: process.stdin, crlfDelay: Infinity })) {
  let reply;
  try {
    reply = await evaluate(JSON.parse(line));
  } catch (err) {
    reply = { error: `Custom function threw error: ${err && err.message !== undefined ? err.message : String(err)}` };
  }
  fs.writeSync(replies, JSON.stringify(reply) + "\n");
}
