"""Speculative decoding: several tokens per pass over the target model's weights, with unchanged outputs.

A drafter proposes up to k tokens for a sequence: prompt lookup (the tokens that followed the latest earlier
occurrence of the sequence's last n tokens, n from `lookup` down to `lookup_min`: no second model) or a draft
model sharing the target's tokenizer (its own KV rows, one per target row, kept in step), or both: lookup where
it finds a match, the model where it does not (its row then catches up on the tokens it did not draft). The
target scores the last token and the draft in one forward of k+1 tokens over its cache (`Runner.verify`), then,
position by position, with the logits processors of non-speculative sampling (penalties over the tokens so far,
bias, temperature, top-k / top-p / min-p):
- greedy: a draft token is accepted while it is the target's argmax; the first that is not is replaced by it;
- sampled: draft token x (drawn from q) is accepted with probability min(1, p(x) / q(x)), else the token is drawn
  from norm(max(0, p - q)); a prompt-lookup draft is a point mass (q(x) = 1). When every draft token is accepted,
  the target's next token is drawn from p as usual. This leaves the output distribution that of non-speculative
  sampling (Leviathan et al., 2023; Chen et al., 2023); the uniforms come from the row's own seeded stream.
  A draft model with a reduced vocabulary (config `vocab_subset`) scores the other ids -inf: q is 0 there, still a
  valid proposal (such tokens are never drafted, only drawn from the residual or as the bonus token).
The keys and values of rejected tokens are rolled back (`Runner.truncate`): nothing stale is visible later.

Adaptivity: a row's draft length grows by one after a fully accepted draft and falls to the accepted count plus
one after a rejection; a row whose drafts are mostly rejected stops speculating for a while.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from bitnetlm.engine.metrics import Metrics
from bitnetlm.engine.sequence import Sequence
from bitnetlm.sampling import RowRandom, reductions
from bitnetlm.sampling.sampler import _penalised, filtered, raw_logprobs, row_tensors

WINDOW = 8  # verifies a row's acceptance rate is judged over
MIN_RATE = 0.4  # below this share of accepted draft tokens a row pauses speculating ...
PAUSE = 16  # ... for this many steps, doubled at each pause in a row


@dataclass(frozen=True)
class SpeculativeConfig:
    """num_tokens: the most tokens drafted a step (k). lookup: prompt lookup's longest n-gram (0: off), down to
    lookup_min. draft: a draft model (a bitnetlm CausalLM with the target's tokenizer), or None; with both, a
    row drafts by lookup where the text repeats and by the model elsewhere. adaptive: adapt each row's draft
    length to its acceptance. max_rows: speculate only in steps that decode at most this many
    rows (each row verifies in a pass of its own, while one decode step serves them all)."""

    num_tokens: int = 4
    lookup: int = 0
    lookup_min: int = 1
    draft: object = None
    adaptive: bool = True
    max_rows: int = 4

    def __post_init__(self):
        if isinstance(self.num_tokens, bool) or not isinstance(self.num_tokens, int) or self.num_tokens < 1:
            raise ValueError(f"--draft-max {self.num_tokens!r}: expected an integer >= 1")
        if not 0 <= self.lookup <= 16 or not 1 <= self.lookup_min <= max(1, self.lookup):
            raise ValueError(
                f"--lookup {self.lookup!r} / --lookup-min {self.lookup_min!r}: expected 1 <= min <= max <= 16 "
                "(lookup 0: off)"
            )
        if isinstance(self.max_rows, bool) or not isinstance(self.max_rows, int) or self.max_rows < 1:
            raise ValueError(f"speculative max_rows {self.max_rows!r}: expected an integer >= 1")

    def replace(self, **changes) -> SpeculativeConfig:
        return dataclasses.replace(self, **changes)

    @property
    def enabled(self) -> bool:
        return self.lookup > 0 or self.draft is not None


class NgramIndex:
    """Prompt lookup's index of a growing token list: for each n-gram (n from 1 to n_max) the latest position at
    which it starts and is followed by at least one more token, so a lookup costs n_max dictionary reads rather
    than a scan of the whole context every step."""

    def __init__(self, n_max: int):
        self.n_max = n_max
        self.seen: list[dict[tuple[int, ...], int]] = [{} for _ in range(n_max + 1)]
        self.length = 0  # tokens indexed: n-grams starting before length - n are in

    def extend(self, tokens: Seq[int]) -> None:
        """Index what `tokens` (the same list, longer) added since the last call."""
        if len(tokens) < self.length:  # (a list that shrank is not the one indexed: start over)
            self.__init__(self.n_max)
        for n in range(1, self.n_max + 1):
            seen = self.seen[n]
            for i in range(max(0, self.length - n), len(tokens) - n):
                seen[tuple(tokens[i : i + n])] = i
        self.length = len(tokens)

    def draft(self, tokens: Seq[int], n_min: int, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the last n tokens (the longest n from
        n_max down to n_min that occurs), or [] when none does."""
        self.extend(tokens)
        for n in range(min(self.n_max, len(tokens) - 1), n_min - 1, -1):
            i = self.seen[n].get(tuple(tokens[-n:]))
            if i is not None:
                return list(tokens[i + n : i + n + k])
        return []


@dataclass
class RowState:
    """A sequence's speculation: its current draft length, recent acceptance, pause, and (draft model) the
    positions its draft row holds."""

    k: int
    history: list[tuple[int, int]] = field(default_factory=list)  # (drafted, accepted) of its last verifies
    paused: int = 0
    pauses: int = 0  # pauses in a row (a window at MIN_RATE or above resets it)
    draft_len: int = 0
    random: RowRandom | None = None  # the draft model's own draws (sampled rows)
    index: NgramIndex | None = None  # prompt lookup's n-grams of the sequence's tokens
    row: int | None = None  # the draft row it was set up on (a preempted sequence comes back on another)


@dataclass
class Draft:
    tokens: list[int]
    q: torch.Tensor | None = None  # [n, V] the draft model's probabilities (sampled rows); None: point masses
    paced: bool = True  # its acceptance counts toward pausing the row (not lookup's beside a draft model)


class Speculator:
    """Drafts, verifies and rolls back for the worker (see the module docstring)."""

    def __init__(
        self,
        config: SpeculativeConfig,
        runner,
        draft_runner=None,
        metrics: Metrics | None = None,
        context: int | None = None,
    ):
        self.config, self.runner, self.draft_runner, self.metrics = config, runner, draft_runner, metrics
        self.context = context or runner.max_seq_len  # no draft reaches past it (a row shifts there instead)
        if metrics is not None:
            metrics.speculating()
        self.rows: dict[Sequence, RowState] = {}
        self.longest = _longest_draft(runner, draft_runner)
        self.drafts = self.drafted = self.accepted = 0  # verifies, draft tokens, accepted draft tokens

    def state(self, s: Sequence) -> RowState:
        st = self.rows.get(s)
        if st is None:
            st = self.rows[s] = RowState(self.config.num_tokens)
            if self.draft_runner is not None and not s.params.greedy:
                seed = None if s.params.seed is None else int(s.params.seed) + 7919 * (s.index + 1)
                gen = None if seed is None else torch.Generator().manual_seed(seed)
                st.random = RowRandom(gen, "cpu")
        if self.draft_runner is not None and st.row != s.row:
            self.draft_runner.reset(s.row)
            st.row, st.draft_len = s.row, 0
        return st

    def release(self, s: Sequence) -> None:
        """s ended: its state goes."""
        self.rows.pop(s, None)

    # ---- drafting -----------------------------------------------------------------------------------
    def propose(self, seqs: list[Sequence]) -> dict[Sequence, Draft]:
        """sequence -> its draft, for the sequences that speculate this step (possibly none)."""
        if len(seqs) > self.config.max_rows:
            return {}
        cap = self.context
        both = self.config.lookup > 0 and self.draft_runner is not None
        want, paused = {}, set()
        for s in seqs:
            if s.shifted and self.draft_runner is not None:
                # (a draft row holds the sequence's tokens at their own positions, which a shifted row no longer
                # does: such a row decodes one token a step; prompt lookup drafts from the text and goes on)
                continue
            st = self.state(s)
            if st.paused:  # (beside a draft model, the pause is the model's: lookup goes on)
                st.paused -= 1
                if not both:
                    continue
                paused.add(s)
            k = min(st.k, s.budget - 1, cap - s.n_cached, self.longest)  # the bonus token counts: up to P + k
            if k > 0:
                want[s] = k
        if not want:
            return {}
        out = {}
        if self.config.lookup:
            out = {s: Draft(self._lookup(s, k), paced=not both) for s, k in want.items()}
            out = {s: d for s, d in out.items() if d.tokens}
        rest = [(s, k) for s, k in want.items() if s not in out and s not in paused]
        if self.draft_runner is not None and rest:  # (its row catches up on the lookup-drafted tokens later)
            out.update(self._model_drafts(rest))
        return out

    def _lookup(self, s: Sequence, k: int) -> list[int]:
        st = self.state(s)
        if st.index is None:
            st.index = NgramIndex(self.config.lookup)
        return st.index.draft(s.tokens, self.config.lookup_min, k)

    def _model_drafts(self, want: list[tuple[Sequence, int]]) -> dict[Sequence, Draft]:
        """k tokens from the draft model for each (sequence, k): its row caught up with the sequence's tokens
        before the last, then up to k one-token steps of all rows together."""
        dr = self.draft_runner
        first: dict[tuple[int, ...], int] = {}  # a prompt the draft prefilled this step -> its row
        for s, _ in want:
            st, p = self.state(s), s.n_cached - 1  # the last token (fed now) sits at position p
            if st.draft_len == 0 and tuple(s.tokens[:p]) in first:  # a sibling choice's prompt: copied
                dr.copy_prefix(first[tuple(s.tokens[:p])], s.row, p)
            elif st.draft_len < p:
                dr.prefill(s.row, s.tokens[st.draft_len : p], st.draft_len)
                if st.draft_len == 0:
                    first[tuple(s.tokens[:p])] = s.row
            st.draft_len = p
        toks: dict[Sequence, list[int]] = {s: [] for s, _ in want}
        qs: dict[Sequence, list[torch.Tensor]] = {s: [] for s, _ in want}
        for j in range(max(k for _, k in want)):
            live = [s for s, k in want if len(toks[s]) < k]
            feed = [s.tokens[-1] if j == 0 else toks[s][-1] for s in live]
            logits = dr.decode([s.row for s in live], feed, [s.n_cached - 1 + j for s in live])
            for i, s in enumerate(live):
                tok, q = self._draft_token(s, logits[i])
                toks[s].append(tok)
                if q is not None:
                    qs[s].append(q)
                self.state(s).draft_len = s.n_cached + j  # (the token fed this step is cached)
        return {s: Draft(t, torch.stack(qs[s]) if qs[s] else None) for s, t in toks.items()}

    def _draft_token(self, s: Sequence, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """The draft model's token for s (greedy: its argmax) and, for sampled rows, the distribution drawn from."""
        if s.params.greedy:
            return int(reductions.argmax(logits[None].float())), None
        p = _probs(logits[None], s, output=None)
        u = self.state(s).random.take(1).to(p.device)
        return _draw(p, u), p

    # ---- verification -------------------------------------------------------------------------------
    def verify(self, s: Sequence, draft: Draft) -> tuple[list[int], list[float], list]:
        """The target scores s's last token and its draft in one forward: (the tokens to emit, their
        log-probabilities, their top log-probabilities or None each). Rolls back the rejected positions."""
        p0 = s.n_cached - 1  # the last token's position
        d = draft.tokens
        logits = self.runner.verify(s.row, [s.tokens[-1], *d], p0)  # [k + 1, V]
        s.written = max(s.written, p0 + 1 + len(d))
        prm = s.params
        if prm.greedy and not (prm.needs_penalties or prm.logit_bias or prm.top_logprobs):
            out, lps = _greedy_accept(d, logits)
            self._settle(s, len(d), len(out) - 1, draft.paced)
            return out, lps, [None] * len(out)
        out, accepted = self._accept(s, d, draft.q, logits)
        top_n = s.params.top_logprobs
        lp, top_v, top_i = raw_logprobs(logits[: len(out)], torch.tensor(out, device=logits.device), top_n)
        tops = (
            [list(zip(top_i[i].tolist(), top_v[i].tolist(), strict=True)) for i in range(len(out))]
            if top_n
            else [None] * len(out)
        )
        self._settle(s, len(d), accepted, draft.paced)
        return out, lp.tolist(), tops

    def _accept(self, s: Sequence, d: list[int], q, logits) -> tuple[list[int], int]:
        """The accepted draft tokens and the one after them (a correction or the bonus), with the count accepted."""
        out: list[int] = []
        greedy = s.params.greedy
        if greedy and not s.params.needs_penalties:  # the argmax of every position at once
            best = reductions.argmax(_penalised(logits, [s.params] * len(logits), None, None)).tolist()
            n = next((i for i, x in enumerate(d) if best[i] != x), len(d))
            return [*d[:n], best[n]], n
        for i, x in enumerate(d):
            if greedy:
                best = _greedy(logits[i : i + 1], s, s.generated + out)
                if best != x:
                    return [*out, best], i
            else:
                p = _probs(logits[i : i + 1], s, output=s.generated + out)
                qx = 1.0 if q is None else float(q[i, x])
                u = float(s.random.take(1))
                if u * qx >= float(p[x]):  # rejected: draw from the residual norm(max(0, p - q))
                    res = p.clone()
                    if q is None:
                        res[x] = 0.0
                    else:
                        res = (p - q[i].to(p.device)).clamp(min=0)
                    if float(res.sum()) <= 0:
                        res = p
                    return [*out, _draw(res, s.random.take(1).to(p.device))], i
            out.append(x)
        tail = logits[len(d) : len(d) + 1]
        if greedy:
            return [*out, _greedy(tail, s, s.generated + out)], len(d)
        p = _probs(tail, s, output=s.generated + out)
        return [*out, _draw(p, s.random.take(1).to(p.device))], len(d)

    def _settle(self, s: Sequence, drafted: int, accepted: int, paced: bool) -> None:
        """After a verify: the caches hold positions up to the last accepted token; adapt the draft length."""
        n = s.n_cached + accepted  # the last token's position + 1 + accepted
        s.n_cached = n
        self.runner.truncate(s.row, n)
        st = self.state(s)
        if self.draft_runner is not None and st.draft_len > n:
            self.draft_runner.truncate(s.row, n)
            st.draft_len = n
        self.drafts += 1
        self.drafted += drafted
        self.accepted += accepted
        s.drafted += drafted
        s.accepted += accepted
        if self.metrics is not None:
            self.metrics.inc("spec_decode_num_drafts_total")
            self.metrics.inc("spec_decode_num_draft_tokens_total", drafted)
            self.metrics.inc("spec_decode_num_accepted_tokens_total", accepted)
        if not self.config.adaptive:
            return
        st.k = min(self.config.num_tokens, st.k + 1) if accepted == drafted else max(1, accepted + 1)
        if not paced:
            return
        st.history = [*st.history[-(WINDOW - 1) :], (drafted, accepted)]
        tried = sum(a for a, _ in st.history)
        if len(st.history) == WINDOW:
            if sum(b for _, b in st.history) < MIN_RATE * tried:
                st.paused, st.history, st.pauses = PAUSE << min(st.pauses, 6), [], st.pauses + 1
            else:
                st.pauses = 0


def _greedy_accept(d: list[int], logits: torch.Tensor) -> tuple[list[int], list[float]]:
    """Greedy acceptance of draft d from the target's logits [len(d) + 1, V] and the emitted tokens' raw
    log-probabilities: one pass over the logits (argmax and logsumexp together) and one copy to the host."""
    best, lse = reductions.argmax_logsumexp(logits)
    lp = logits.gather(1, best[:, None])[:, 0].float() - lse
    best, lp = torch.stack((best.double(), lp.double())).tolist()
    n = next((i for i, x in enumerate(d) if int(best[i]) != x), len(d))
    return [*d[:n], int(best[n])], lp[: n + 1]


def _longest_draft(runner, draft_runner) -> int:
    """The longest draft whose rejection both runners can roll back: a row writes at most k positions past the
    last one it keeps (a verify's draft; a draft model's k - 1 decodes and a padding write), and a sliding
    layer's ring holds `slack` positions past it."""
    rings = [r.ring for r in (runner, draft_runner) if r is not None and r.ring is not None]
    return min((ring.slack for ring in rings), default=1 << 30)


def _penalised_row(logits: torch.Tensor, s: Sequence, output) -> torch.Tensor:
    """logits [1, V] with s's penalties (over `output`, the tokens generated so far; None: none) and bias."""
    p = s.params
    pen = p.needs_penalties and output is not None
    return _penalised(logits, [p], [s.tokens[: s.n_prompt]] if pen else None, [output] if pen else None)


def _greedy(logits: torch.Tensor, s: Sequence, output) -> int:
    """The greedy token of non-speculative sampling: the first argmax of the penalised logits."""
    return int(reductions.argmax(_penalised_row(logits, s, output)))


def _probs(logits: torch.Tensor, s: Sequence, output) -> torch.Tensor:
    """The processed distribution [V] that non-speculative sampling draws s's token from."""
    x = _penalised_row(logits, s, output)
    return torch.softmax(filtered(x, row_tensors([s.params], x.shape[1], x.device)), dim=-1)[0]


def _draw(p: torch.Tensor, u: torch.Tensor) -> int:
    """The token at uniform u of distribution p [V] (the first whose cumulative mass exceeds u times the total)."""
    cum = p.double().cumsum(dim=0)
    j = int(torch.searchsorted(cum, u.double().reshape(1) * cum[-1:], right=True))
    return min(j, int(torch.nonzero(p > 0).max()))
