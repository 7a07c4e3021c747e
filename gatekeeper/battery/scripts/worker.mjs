// gatekeeper's JavaScript worker: one request per stdin line, one reply per line on the file descriptor
// named by argv[2] (stdout and stderr are the user's, and go nowhere).
// An assertion request is {code | file + fn, output, context}; its reply is {kind: "boolean"|"number"|"grading",
// ...} or {error}, read as promptfoo 0.123.1's javascript assertion reads a result (src/assertions/javascript.ts).
// A call request is {call: true, code | file + fn, args}: a transform or a nunjucks filter; its reply is
// {value, text} (JSON, and the value as text), {undefined: true} or {error}. TypeScript files load through node's own type stripping.
// A schema request is {schema, values, modules}: each value checked against a JSON schema by promptfoo's own ajv
// (required from promptfoo's package.json, set up as promptfoo's getAjv sets it up); its reply is {valid: [bool]} or {error}.
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

async function exported(file, fn) {
  const ns = await import(pathToFileURL(file).href);
  let mod = ns?.default?.default || ns?.default || ns;
  if (fn) mod = mod[fn];
  if (typeof mod === "function") return mod;
  if (mod?.default && typeof mod.default === "function") return mod.default;
  return null;
}

async function fromFile(file, fn, output, context) {
  const f = await exported(file, fn);
  if (f) return f(output, context);
  throw new Error(`Assertion malformed: ${file} must export a function or have a default export as a function`);
}

// A transform (promptfoo's src/util/transform.ts: one line is returned, several are a body) or a filter.
async function call({ code, file, fn, args }) {
  let f;
  if (file) {
    f = await exported(file, fn);
    if (!f) throw new Error(`${file} must export a function, have a default export as a function, or export the function "${fn}"`);
  } else {
    const body = code.includes("\n") ? code : `return ${code}`;
    f = new Function("output", "context", "process", body);
    args = [...args, processShim];
  }
  const value = await f(...args);
  // text: the value as promptfoo's coerceString hands it to the assertions that read text
  return value === undefined ? { undefined: true } : { value, text: typeof value === "string" ? value : JSON.stringify(value) };
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

let ajv;
const validators = new Map();  // one compile per schema: ajv refuses a second schema with the same $id

function validator(schema, modules) {
  const key = JSON.stringify(schema);
  if (!validators.has(key)) {
    if (!ajv) {
      const load = createRequire(modules);
      ajv = new (load("ajv").default)({ strictSchema: true });
      load("ajv-formats").default(ajv);
    }
    validators.set(key, ajv.compile(schema));
  }
  return validators.get(key);
}

for await (const line of readline.createInterface({ input: process.stdin, crlfDelay: Infinity })) {
  const request = JSON.parse(line);
  let reply;
  try {
    if (request.schema !== undefined) {
      const validate = validator(request.schema, request.modules);
      reply = { valid: request.values.map((v) => validate(v)) };
    } else reply = request.call ? await call(request) : await evaluate(request);
    reply = JSON.stringify(reply);  // a value JSON cannot carry (a cycle, a BigInt) is the function's error
  } catch (err) {
    const message = err && err.message !== undefined ? err.message : String(err);
    reply = JSON.stringify({ error: request.call || request.schema !== undefined ? message : `Custom function threw error: ${message}` });
  }
  fs.writeSync(replies, reply + "\n");
}
