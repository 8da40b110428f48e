"""Per-episode token bookkeeping of the agent server: every call matched to the episode's
earlier calls, token-in/token-out exact (docs/agents.md).

An episode is a forest of nodes, one per sampled choice of an accepted call. A node holds the
ids its call added after its parent's ids (a root: the whole rendered prompt; a child: the
closing ids and the observation ids), then its sampled ids and their rollout log-probs.

Matching a chat call (messages M, tools T). Messages are compared in canonical form
(engine.data.rows.check_messages; an assistant message by its content, "" for none, its
reasoning_content and its tool calls' names and arguments, ids ignored). A node's key is its
call's messages plus the assistant message it returned. The call extends the node of the same
tools whose key is the longest strict prefix of M (the earliest such node on a tie); its
context is that node's ids exactly (prompt, sampled ids, earlier observations), then the
closing ids when the node's turn did not end with the end-of-turn marker (cut at max_tokens or
a stop string: the marker, loss mask 0), then the ids of M's new messages rendered after the
node's turn (the template delta of docs/multi-turn.md). No such node: the call starts a new
trajectory, M rendered with the generation prompt. A call repeating earlier messages exactly
(a retry) is therefore a new branch. Completions: a node's key is its prompt text plus the text
it returned (a text prompt may extend or equal it; the rest of the text is tokenized without
special tokens), or its prompt ids plus its sampled ids (an id prompt).

Limits (ApiError): a finished or timed-out episode (410), more than env.max_turns calls (400),
a context over train.seq_length, or one whose explicit max_tokens would not fit in
train.seq_length + 1 ids (400 "context length exceeded"). Calls are indexed in the order they
are accepted; call c choice k samples with protocol.call_seed(episode seed, c, k).

Trajectories: one per leaf (a node no later call extended), in node order; its ids are its
chain's ids, the loss mask 1 exactly on sampled ids, turns = the calls of its chain.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

from engine.api.backend import call_seed
from engine.api.budget import Window, reply_budget
from engine.api.requests import ApiError, Call, Limits, bad
from engine.api.tokens import TemplateRules
from engine.data.rows import check_messages


def canonical(message: dict) -> str:
    """A checked message (check_messages) in the form calls are matched by."""
    if message.get("role") != "assistant":
        return json.dumps(message, sort_keys=True, ensure_ascii=False, default=str)
    core = {"role": "assistant", "content": message.get("content") or "",
            "reasoning_content": message.get("reasoning_content") or "",
            "tool_calls": [[c["function"]["name"], c["function"].get("arguments", {})]
                           for c in message.get("tool_calls", [])]}
    return json.dumps(core, sort_keys=True, ensure_ascii=False, default=str)


@dataclass
class Node:
    index: int
    call: int
    choice: int
    parent: int | None
    kind: str                 # "chat", "text" or "ids"
    scope: str                # chat: the canonical tools ("" for none)
    key: tuple | str          # what a later call must extend (module docstring)
    added: list[int]          # ids after the parent's (a root: its prompt)
    sampled: list[int]
    logprobs: list[float]
    finish_reason: str
    messages: list[dict] | None = None   # chat: the call's messages (before the reply)


@dataclass
class Plan:
    """An accepted call: where it continues and what it samples."""

    call: int
    kind: str
    scope: str
    key: tuple | str
    parent: int | None
    added: list[int]
    context: list[int]
    budget: int
    seeds: list[int]
    messages: list[dict] | None = None
    tools: list[dict] | None = None


@dataclass
class Trajectory:
    """One trajectory of an episode, as the trainer takes it (response = everything after the
    prompt: sampled ids with mask 1, closing and observation ids with mask 0)."""

    index: int
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float]
    turns: int
    finish_reason: str
    calls: list[int] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    @property
    def loss_mask(self) -> list[int]:
        return [0] * len(self.prompt_ids) + self.response_mask

    @property
    def rollout_logprobs(self) -> list[float]:
        return [0.0] * len(self.prompt_ids) + self.response_logprobs


class Episode:
    """One episode's calls (module docstring); thread-safe."""

    def __init__(self, episode_id: str, seed: int, rules: TemplateRules, limits: Limits) -> None:
        self.id, self.seed, self.rules, self.limits = episode_id, seed, rules, limits
        self.nodes: list[Node] = []
        self.calls = 0
        self.lock = threading.Lock()
        self.started: float | None = None
        self.deadline: float | None = None
        self.closed: str | None = None     # why no more calls are taken

    def start(self, timeout_s: float | None) -> None:
        """The user's function was called now; calls after `timeout_s` are refused."""
        with self.lock:
            self.started = time.monotonic()
            self.deadline = None if timeout_s is None else self.started + timeout_s

    def close(self, reason: str) -> None:
        with self.lock:
            self.closed = self.closed or reason

    @property
    def live(self) -> bool:
        """Started, and still taking calls (the batcher waits for live episodes)."""
        return self.started is not None and self.refusal() is None

    def refusal(self) -> str | None:
        if self.closed:
            return self.closed
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return "its function ran past its deadline"
        return None

    def _check_open(self) -> None:
        why = self.refusal()
        if why:
            raise ApiError(410, f"episode {self.id} takes no more calls: {why}")

    def plan(self, call: Call) -> Plan:
        """Accept `call`: its index, parent, context and budget (ApiError if refused)."""
        with self.lock:
            self._check_open()
            if self.limits.max_turns is not None and self.calls >= self.limits.max_turns:
                raise bad(f"episode {self.id} made its {self.limits.max_turns} calls "
                          "(env.max_turns)")
            plan = self._chat(call) if call.kind == "chat" else self._completion(call)
            plan.budget = self._budget(call, len(plan.context))
            plan.seeds = [call_seed(self.seed, plan.call, k) for k in range(call.n)]
            self.calls += 1
            return plan

    def _match(self, kind: str, scope: str, key) -> Node | None:
        best = None
        for node in self.nodes:
            k = node.key
            if node.kind != kind or node.scope != scope or len(k) > len(key) \
                    or (kind == "chat" and len(k) == len(key)) or key[:len(k)] != k:
                continue
            if best is None or len(k) > len(best.key):
                best = node
        return best

    def _chat(self, call: Call) -> Plan:
        scope = json.dumps(call.tools, sort_keys=True) if call.tools else ""
        key = tuple(canonical(m) for m in call.messages)
        parent = self._match("chat", scope, key)
        if parent is None:
            added = self.rules.prompt_ids(call.messages, call.tools)
            return Plan(self.calls, "chat", scope, key, None, added, list(added), 0, [],
                        call.messages, call.tools)
        new = call.messages[len(parent.key):]
        added = self.rules.closing_ids(parent.sampled) + self.rules.observation_ids(
            parent.messages, new, call.tools)
        return Plan(self.calls, "chat", scope, key, parent.index, added,
                    self.ids(parent) + added, 0, [], call.messages, call.tools)

    def _completion(self, call: Call) -> Plan:
        kind = "text" if isinstance(call.prompt, str) else "ids"
        key = call.prompt if kind == "text" else tuple(call.prompt)
        parent = self._match(kind, "", key)
        rest = key[len(parent.key):] if parent is not None else key
        if kind == "text":
            added = self.rules.text_ids(rest, first=parent is None) if rest else []
        else:
            added = list(rest)
            self.rules.check_ids(added)
        before = self.ids(parent) if parent is not None else []
        return Plan(self.calls, kind, "", key, None if parent is None else parent.index,
                    added, before + added, 0, [])

    def _budget(self, call: Call, context: int) -> int:
        """The call's reply budget by the one context-budget rule (engine.api.budget) in a
        trajectory's window of train.seq_length + 1 ids."""
        most = self.limits.seq_length + 1
        window = Window(most, "this call's context", "tokens",
                        f"a trajectory holds at most {most} (train.seq_length + 1)", "messages")
        return reply_budget(window, context, call.max_tokens, call.max_tokens,
                            self.limits.max_new_tokens)

    def record(self, plan: Plan, choice: int, ids: list[int], logprobs: list[float],
               finish_reason: str, returned) -> Node:
        """Keep choice `choice` of an accepted call: its sampled ids and log-probs, and what
        the client got back (chat: the assistant message; completions: the text)."""
        if plan.kind == "chat":
            message = {**returned, "content": returned.get("content") or ""}
            key = plan.key + (canonical(check_messages([message], "reply", "server")[0]),)
        elif plan.kind == "text":
            key = plan.key + returned
        else:
            key = plan.key + tuple(ids)
        with self.lock:
            self._check_open()
            node = Node(len(self.nodes), plan.call, choice, plan.parent, plan.kind, plan.scope,
                        key, list(plan.added), list(ids), [float(x) for x in logprobs],
                        finish_reason, plan.messages)
            self.nodes.append(node)
            return node

    def chain(self, node: Node | None) -> list[Node]:
        out = []
        while node is not None:
            out.append(node)
            node = None if node.parent is None else self.nodes[node.parent]
        return out[::-1]

    def ids(self, node: Node | None) -> list[int]:
        """Every id of `node`'s chain: prompt, sampled, closing and observation ids."""
        return [t for n in self.chain(node) for t in n.added + n.sampled]

    def trajectories(self) -> list[Trajectory]:
        """One per leaf, in node order (module docstring)."""
        with self.lock:
            extended = {n.parent for n in self.nodes if n.parent is not None}
            leaves = [n for n in self.nodes if n.index not in extended]
            out = []
            for t, leaf in enumerate(leaves):
                chain = self.chain(leaf)
                ids, mask, logprobs = [], [], []
                for i, n in enumerate(chain):
                    added = n.added if i else []
                    ids += added + n.sampled
                    mask += [0] * len(added) + [1] * len(n.sampled)
                    logprobs += [0.0] * len(added) + n.logprobs
                out.append(Trajectory(t, list(chain[0].added), ids, mask, logprobs, len(chain),
                                      leaf.finish_reason, [n.call for n in chain]))
            return out
