"""Stop strings on the agent endpoint (engine.api.replies, rule 1; docs/agents.md): the reply
ends before the stop string in ids as in text, so a ReAct scaffold that appends the stop
string and an observation after the returned text (OpenAI semantics) trains a trajectory
that holds every piece of text once, exactly the transcript it sent."""
from __future__ import annotations

import engine.api.replies as replies
from engine.api.replies import stop_cut
from tests.test_agent_server import LIMITS, ScriptedBackend, client, serving, tok  # noqa: F401

STOP = "\nObservation:"


def react_script(prompt: str, seed: int) -> str:
    """The model writes a thought, an action, and hallucinates the observation (which the
    stop string must cut); after a real observation it answers."""
    if "Observation: 4" in prompt:
        return " Final Answer: 4"
    return "Thought: add\nAction: calc[2+2]\nObservation: 5\nFinal Answer: 5"


def react_transcript(tok):
    """(transcript the scaffold sent and received, the episode's one trajectory)."""
    backend = ScriptedBackend(tok, script=react_script)
    with serving(tok, backend) as server:
        ep = server.open_episode(seed=3)
        c = client(server.base_url(ep.id))
        text = "Question: 2+2?\n"
        first = c.completions.create(model="m", prompt=text, stop=[STOP], max_tokens=100)
        assert first.choices[0].finish_reason == "stop"
        text += first.choices[0].text + STOP + " 4\n"      # the scaffold's observation
        second = c.completions.create(model="m", prompt=text, stop=[STOP], max_tokens=100)
        text += second.choices[0].text
        (trajectory,) = ep.trajectories()
    return text, trajectory


def test_a_react_scaffold_trains_its_transcript_once(tok):
    """decode(trajectory) == the transcript, with one "Observation:"; the model's hallucinated
    observation is not in it. Negative control: the old rule (keep the ids through the token
    that completes the stop string, return the text before it) puts the stop string in the
    trajectory twice."""
    text, t = react_transcript(tok)
    assert tok.decode(t.token_ids, skip_special_tokens=True) == text
    assert text.count("Observation:") == 1 and "Observation: 5" not in text
    trained = [i for i, m in zip(t.token_ids, t.loss_mask) if m]
    assert tok.decode(trained, skip_special_tokens=True) == \
        "Thought: add\nAction: calc[2+2] Final Answer: 4"

    def old_rule(text_of, ids, stops):
        if not any(s in text_of(ids) for s in stops):
            return None
        lo = next(n for n in range(1, len(ids) + 1) if any(s in text_of(ids[:n]) for s in stops))
        full = text_of(ids[:lo])
        return lo, full[:min(full.find(s) for s in stops if s in full)]

    original, replies.stop_cut = replies.stop_cut, old_rule
    try:
        old_text, old_t = react_transcript(tok)
    finally:
        replies.stop_cut = original
    assert old_text == text
    assert tok.decode(old_t.token_ids, skip_special_tokens=True).count("Observation:") == 2


def test_a_token_spanning_the_stop_string_is_dropped_with_it():
    """Pieces "ab" | "c\\nObs" | "ervation:" | "x" with stop "\\nObservation:": the text before
    the stop is "abc", but the token "c\\nObs" spans the stop's start, so the reply keeps one
    id and returns "ab" (what the kept ids spell); no stop string: None."""
    pieces = ["ab", "c\nObs", "ervation:", "x"]
    def text_of(ids):
        return "".join(pieces[i] for i in ids)

    assert stop_cut(text_of, [0, 1, 2, 3], [STOP]) == (1, "ab")
    assert stop_cut(text_of, [0, 1, 2, 3], ["ervation"]) == (2, "abc\nObs")
    assert stop_cut(text_of, [0, 2, 3], ["x"]) == (2, "abervation:")
    assert stop_cut(text_of, [0, 1], ["zz"]) is None
    assert stop_cut(text_of, [3, 0], ["x"]) == (0, "")
