"""The records passed between layers: the contract between the proxy, the store and everything downstream.

Records import nothing of ours. Token id and logprob lists are plain lists for speed (they come straight out of
the engine's JSON); treat them as read-only once a record is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Call.status values.
OK = "ok"  # the engine answered and the agent got the answer
ERROR = "error"  # the call failed (bad request, upstream down, upstream error); see Call.error
CANCELLED = "cancelled"  # the agent went away before the answer was complete; never a training parent

# Call.token_source values.
ENGINE = "engine"  # prompt and completion ids are the engine's own (vLLM return_token_ids)
NONE = "none"  # the upstream returned no token ids: text only
RETOKENIZED = "retokenized"  # ids a tokenizer made after the fact (harness retokenize), never the engine's


@dataclass(frozen=True, slots=True)
class Choice:
    """One sampled completion of a call (a call with n=2 has two)."""

    index: int  # the choice index the engine gave it (0..n-1)
    completion_ids: list[int] | None  # every token the engine sampled, stop token included; None if not returned
    logprobs: list[float] | None  # logprob of each sampled token, same length as completion_ids
    finish_reason: str | None  # "stop", "length", "tool_calls", ... as the engine said; None if cut off
    text: str | None  # the text content the agent received (chat: message.content; completions: text)
    tool_calls: list[dict] | None = None  # tool calls the agent received, OpenAI shape (chat only)
    reasoning: str | None = None  # reasoning / thinking text, when the engine returned it separately


@dataclass(frozen=True, slots=True)
class Call:
    """One LLM call as the proxy saw it: what the agent asked, what the engine did, what the agent got."""

    call_id: str  # unique id (uuid4 hex) of this call
    run_id: str  # the proxy run (one process lifetime) that recorded it
    episode_id: str  # the episode the call belongs to
    call_index: int  # 0-based arrival order within the episode
    endpoint: str  # "chat" (/v1/chat/completions) or "completions" (/v1/completions)
    stream: bool  # whether the agent asked for a streamed answer
    requested_model: str | None  # the model name the agent asked for (e.g. "gpt-4o-mini")
    served_model: str | None  # the model the engine served it with
    role_key: str  # role fingerprint: hash of requested_model, system_hash and tools_hash
    system_hash: str | None  # hash of the system / developer prompt, None if there is none
    tools_hash: str | None  # hash of the canonical tool list, None if no tools were offered
    request: bytes  # the request body as JSON, with api keys and secrets removed
    response: bytes | None  # the answer as JSON (a stream is assembled into one completion object)
    prompt_ids: list[int] | None  # the engine's prompt token ids (the chat template applied)
    choices: list[Choice]  # one per sampled completion, ordered by index
    token_source: str  # ENGINE or NONE
    status: str  # OK, ERROR or CANCELLED
    http_status: int  # the HTTP status the agent got (0 if the agent went away first)
    error: str | None  # what went wrong, for ERROR and CANCELLED calls
    started_at: float  # when the proxy received the request (unix seconds)
    latency_ms: float  # from receiving the request to sending the last byte of the answer
    ttft_ms: float | None  # time to first token: first content byte sent to the agent (streams only)
    weight_version: int  # the policy weight version the engine was serving when the call started
    prompt_tokens: int | None = None  # usage: prompt length in tokens
    completion_tokens: int | None = None  # usage: sampled tokens over all choices
    extra: dict = field(default_factory=dict)  # free-form notes (e.g. sampling overrides that were applied)
    role: str | None = None  # the name of the role rule the call matched (proxy/roles.py); None: no rule matched
    # The policy that served it (the role's own, or "policy", the default) when the policy engine did; None for a
    # frozen role's call (its fixed model served it) and in record-only mode (no policy serves there).
    policy: str | None = None


@dataclass(frozen=True, slots=True)
class Episode:
    """A unit of agent work: all calls one agent run made for one task."""

    episode_id: str  # unique id; chosen by the user (URL) or minted by the proxy
    run_id: str  # the proxy run in which the episode started
    created_at: float  # unix seconds
    source: str  # how it was opened: "url", "api_key", "default", or "runner" (by a dataset run)
    meta: dict = field(default_factory=dict)  # free-form metadata given when the episode was opened


# EpisodeOutcome.status values: how the agent's run ended (independent of whether its answer was right).
FINISHED = "finished"  # the agent exited 0 and printed an answer
CRASHED = "crashed"  # the agent exited non-zero
TIMED_OUT = "timeout"  # the agent ran past the episode timeout; its whole process group was killed
NO_OUTPUT = "no_output"  # the agent exited 0 but printed nothing
INFRA_ERROR = "infra_error"  # the engine was unreachable: not the agent's fault (retried)
INTERRUPTED = "interrupted"  # the run was stopped (Ctrl-C) while the agent was running
NOT_PREPARED = "not_prepared"  # the task's environment could not be made (harness/running/harbor.py says why): not run


@dataclass(frozen=True, slots=True)
class Task:
    """One task of a dataset, as given to the agent (on stdin and in HARNESS_TASK)."""

    task_id: str  # unique within the dataset (a field "id", or the line / row number)
    data: dict  # the task object itself: prompt, reference answer, anything the judge needs
    split: str = "train"  # dataset split it came from


@dataclass(frozen=True, slots=True)
class EpisodeOutcome:
    """How one run of the agent on one task ended."""

    episode_id: str  # the episode its calls are recorded under
    run_id: str  # the run (harness run / train) it belongs to
    task_id: str  # the task it worked on
    repeat_index: int  # 0..repeat-1: the sample index within the task's group (GRPO group member)
    attempt: int  # 1 + how many times it was retried for infrastructure failures
    status: str  # FINISHED, CRASHED, TIMED_OUT, NO_OUTPUT, INFRA_ERROR, INTERRUPTED or NOT_PREPARED
    exit_code: int | None  # the agent process's exit code (None if it was killed)
    answer: str | None  # the agent's answer: its final JSON line's "answer", else its last non-empty line
    error: str | None  # why it failed, in a sentence (with the tail of its stderr where useful)
    started_at: float  # unix seconds
    duration_ms: float  # wall time of the agent process
    log_path: str | None  # the agent's stderr, one file per episode
    sandbox: dict | None = None  # a sandboxed episode: {"backend", "workdir", "flags": [...], "open_ms", "close_ms"}


@dataclass(frozen=True, slots=True)
class Judgement:
    """A judge's score of one episode. Re-judging adds rows; nothing is overwritten."""

    episode_id: str  # the episode judged
    judge: str  # the judge's name (its spec, e.g. "harness.judges:exact_match")
    judge_hash: str  # hash of the judge's source code: a changed judge is a different judge
    reward: float | None  # the score; None when the judge failed
    details: dict  # whatever else the judge returned (e.g. {"expected": "42", "got": "41"})
    error: str | None  # why the judge failed (raised, timed out, returned a wrong type)
    created_at: float  # unix seconds


@dataclass(frozen=True, slots=True)
class Break:
    """Why a call's choice does not continue the closest earlier timeline (harness/core/merge.py): for the first choice
    of a call that starts or leaves a timeline, and for every sibling on the same prompt (n_branch)."""

    call_id: str  # the call
    choice_index: int  # its choice
    reason: str  # first_call, new_role, system_prompt_changed, tools_changed, history_changed, retokenization_drift,
    #              reply_edited, template_drops_reasoning, sub_agent (a timeline an earlier tool call started), or
    #              n_branch: choice 1.. of a call with n>1 choices, or a call that repeats a prompt
    position: int | None = None  # first differing token position in the prompt (history_changed, drift, edited)
    ours: list[int] | None = None  # a few tokens of the closest earlier timeline from that position
    theirs: list[int] | None = None  # the same span of this call's prompt
    parent_call_id: str | None = None  # sub_agent: the earlier call whose tool call started this timeline
    parent_tool_call_id: str | None = None  # sub_agent: that tool call's id (choices.tool_calls[].id)


@dataclass(frozen=True, slots=True)
class Sample:
    """One training sequence: calls that extend each other, merged (a root-to-leaf path of an episode's tree)."""

    episode_id: str  # the episode it comes from
    role_key: str  # the role whose calls it merges
    call_ids: list[str]  # the calls on the path, in order
    choice_indices: list[int]  # the choice of each call on the path (calls with n>1 choices branch the tree)
    token_ids: list[int]  # the leaf's prompt ids + completion ids
    loss_mask: list[int]  # 1 where the engine sampled the token, else 0
    logprobs: list[float]  # the engine's logprob where loss_mask is 1, else 0.0
    reward: float | None = None  # the episode's reward, when known (stored samples: the episode's judgement)
    truncation: list[str] = field(default_factory=list)  # why it was cut short (max_tokens, max_turns...); [] if not
