// The OpenAI Node SDK, two calls: a forced tool call, then a streamed answer that reads the tool's result.
//
// A standalone agent with no harness imports. `new OpenAI()` reads OPENAI_BASE_URL and OPENAI_API_KEY from the
// environment; the model is named as the agent was written for it. It reads its task ({"id": ..., "question":
// ...}) from HARNESS_TASK, else from stdin. The last line on stdout is {"answer": "..."}; logs go to stderr.
//
//   (cd examples/clients/node_agent && npm ci)
//   OPENAI_BASE_URL=http://127.0.0.1:8400/v1 OPENAI_API_KEY=sk-local \
//       node examples/clients/node_agent/agent.mjs < <(head -1 examples/clients/tasks.jsonl)

import OpenAI from "openai";

const MODEL = "gpt-4o-mini";
const SYSTEM_PROMPT = "You solve arithmetic word problems. Use the add tool, then state the result.";
// strict: vLLM constrains the call's arguments to the schema (integers only here).
const TOOLS = [{
  type: "function",
  function: {
    name: "add",
    description: "Add two integers.",
    parameters: {
      type: "object",
      properties: { a: { type: "integer" }, b: { type: "integer" } },
      required: ["a", "b"],
      additionalProperties: false,
    },
    strict: true,
  },
}];

// The tool; a bad call comes back as an error text the model sees, never as an exception.
function add(argumentsJson) {
  try {
    const { a, b } = JSON.parse(argumentsJson || "{}");
    if (!Number.isInteger(a) || !Number.isInteger(b)) return "error: arguments must be two integers";
    return String(BigInt(a) + BigInt(b));
  } catch (err) {
    return `error: ${err.message}`;
  }
}

async function readTask() {
  let raw = process.env.HARNESS_TASK;
  if (!raw) {
    const chunks = [];
    for await (const chunk of process.stdin) chunks.push(chunk);
    raw = Buffer.concat(chunks).toString("utf8");
  }
  const task = JSON.parse(raw);
  if (typeof task !== "object" || task === null || typeof task.question !== "string") {
    throw new Error(`expected a JSON object with a 'question' string, got ${raw.slice(0, 200)}`);
  }
  return task;
}

async function main() {
  const task = await readTask();
  const client = new OpenAI();
  const messages = [
    { role: "system", content: SYSTEM_PROMPT },
    { role: "user", content: task.question },
  ];
  // Turn 1: the whole reply at once, with a tool call required.
  const completion = await client.chat.completions.create({
    model: MODEL, messages, tools: TOOLS, tool_choice: "required", parallel_tool_calls: false,
    max_tokens: 256, temperature: 0.8,
  });
  const reply = completion.choices[0].message;
  const calls = reply.tool_calls ?? [];
  messages.push({ role: "assistant", content: reply.content ?? "", ...(calls.length ? { tool_calls: calls } : {}) });
  let result = "";
  for (const call of calls) {
    result = add(call.function.arguments);
    console.error(`add(${call.function.arguments}) -> ${result}`);
    messages.push({ role: "tool", tool_call_id: call.id, content: result });
  }
  // Turn 2: the answer, streamed.
  const stream = await client.chat.completions.create({
    model: MODEL, messages, tools: TOOLS, max_tokens: 48, temperature: 0.8, stream: true,
  });
  let text = "";
  for await (const chunk of stream) text += chunk.choices[0]?.delta?.content ?? "";
  console.log(JSON.stringify({ id: task.id ?? null, answer: text.trim() || result }));
}

main().catch((err) => {
  console.error(err);
  process.exit(1);
});
