#!/usr/bin/env bash
# A shell-script agent: curl for HTTP, jq for JSON, nothing else. A forced tool call (one JSON answer), the
# tool run by jq, then a streamed answer (server-sent events read line by line) that reads the tool's result.
#
# A standalone agent with no harness imports: it POSTs to $OPENAI_BASE_URL/chat/completions with
# `Authorization: Bearer $OPENAI_API_KEY`, and reads its task ({"id": ..., "question": ...}) from HARNESS_TASK,
# else from stdin. The last line on stdout is {"answer": "..."}; logs go to stderr.
#
#   OPENAI_BASE_URL=http://127.0.0.1:8400/v1 OPENAI_API_KEY=sk-local \
#       bash examples/clients/curl_agent.sh < <(head -1 examples/clients/tasks.jsonl)
set -euo pipefail

MODEL="gpt-4o-mini"
BASE_URL="${OPENAI_BASE_URL:-https://api.openai.com/v1}"
BASE_URL="${BASE_URL%/}"
SYSTEM_PROMPT="You solve arithmetic word problems. Use the add tool, then state the result."
# strict: vLLM constrains the call's arguments to the schema (integers only here).
TOOLS='[{"type": "function", "function": {"name": "add", "description": "Add two integers.", "strict": true,
  "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                 "required": ["a", "b"], "additionalProperties": false}}}]'

task="${HARNESS_TASK:-$(cat)}"
question="$(jq -er '.question | strings' <<<"$task")" || { echo "the task has no 'question' string: $task" >&2; exit 2; }

# POST a JSON body; the response body goes to stdout. --fail-with-body: an HTTP error ends the agent, with the
# server's message on stderr.
post() {
    curl --silent --show-error --fail-with-body --no-buffer --max-time 120 \
        -H "Content-Type: application/json" -H "Authorization: Bearer ${OPENAI_API_KEY:-}" \
        --data-binary @- "$BASE_URL/chat/completions"
}

messages="$(jq -n --arg system "$SYSTEM_PROMPT" --arg question "$question" \
    '[{role: "system", content: $system}, {role: "user", content: $question}]')"

# Turn 1: one JSON answer, with a tool call required.
reply="$(jq -nc --arg model "$MODEL" --argjson messages "$messages" --argjson tools "$TOOLS" \
    '{model: $model, messages: $messages, tools: $tools, tool_choice: "required", parallel_tool_calls: false,
      max_tokens: 256, temperature: 0.8}' | post)" || { echo "turn 1 failed: $reply" >&2; exit 1; }
message="$(jq -c '.choices[0].message | {role, content: (.content // ""), tool_calls} | del(..|nulls)' <<<"$reply")"
messages="$(jq -c --argjson m "$message" '. + [$m]' <<<"$messages")"
result=""
while IFS=$'\t' read -r id arguments; do
    # The tool: a + b, or an error text the model sees when the arguments are not two integers.
    result="$(jq -r 'if (.a | type) == "number" and (.b | type) == "number" then .a + .b
                     else "error: arguments must be two integers" end' <<<"$arguments" 2>/dev/null \
              || echo "error: arguments are not JSON")"
    echo "add($arguments) -> $result" >&2
    messages="$(jq -c --arg id "$id" --arg result "$result" \
        '. + [{role: "tool", tool_call_id: $id, content: $result}]' <<<"$messages")"
done < <(jq -r '.choices[0].message.tool_calls // [] | .[] | [.id, .function.arguments] | @tsv' <<<"$reply")

# Turn 2: the answer streamed as server-sent events, `data: {chunk}` lines up to `data: [DONE]`.
answer=""
while IFS= read -r line; do
    line="${line%$'\r'}"
    [[ "$line" == "data: "* ]] || continue
    data="${line#data: }"
    [[ "$data" == "[DONE]" ]] && break
    answer+="$(jq -j '.choices[0].delta.content // empty' <<<"$data"; printf x)"
    answer="${answer%x}"  # printf x keeps the chunk's trailing newlines, which $(...) would strip
done < <(jq -nc --arg model "$MODEL" --argjson messages "$messages" --argjson tools "$TOOLS" \
    '{model: $model, messages: $messages, tools: $tools, max_tokens: 48, temperature: 0.8, stream: true}' | post)
wait $! || { echo "turn 2 failed" >&2; exit 1; }  # the exit status of curl in the process substitution

jq -nc --argjson task "$task" --arg answer "$answer" --arg result "$result" \
    '{id: $task.id, answer: ((($answer | gsub("^\\s+|\\s+$"; "")) | select(length > 0)) // $result)}'
