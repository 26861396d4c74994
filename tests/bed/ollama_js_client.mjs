// Drives the real `ollama` JavaScript client (npm, installed by scripts/install-clients) against
// slotkeeper's Ollama surface and prints what it read, one JSON object, for
// tests/test_ollama_clients_real.py to check. Usage:
//   node ollama_js_client.mjs <node_modules folder> <host> <model>
import { pathToFileURL } from "node:url";
import path from "node:path";

const [modules, host, model] = process.argv.slice(2);
const { Ollama } = await import(pathToFileURL(path.join(modules, "ollama", "dist", "index.mjs")));
const client = new Ollama({ host, headers: { "X-Session-Id": "ollama-js-1" } });
const out = {};

out.list = [await client.list(), await client.list()];
out.show = await client.show({ model });

const messages = [
  { role: "system", content: "You are terse." },
  { role: "user", content: "Name three colours." },
];
const options = { temperature: 0, num_predict: 5 };
out.chat = await client.chat({ model, messages, stream: false, options });
const parts = [];
for await (const part of await client.chat({ model, messages, stream: true, options })) {
  parts.push(part);
}
out.chatStream = parts;

out.generate = await client.generate({ model, prompt: "Count: one two", stream: false, options });
out.generateMore = await client.generate({
  model, prompt: "Go on.", context: out.generate.context, stream: false, options,
});
const genParts = [];
for await (const part of await client.generate({ model, prompt: "Say hi.", stream: true, options })) {
  genParts.push(part);
}
out.generateStream = genParts;

out.embed = await client.embed({ model, input: ["hello", "world"] });
process.stdout.write(JSON.stringify(out));
