"""The speculative cycle of one step: StepPlan -> drafts -> ONE packed target forward ->
verdicts -> commits.

Contract, per step (the scheduler decided who runs and how many tokens/drafts each):
  propose(plan)                  one `drafter.propose(jobs)` per drafter for all the step's
                                 drafting requests (the draft model packs them)
  forward(plan, drafts)          the step's rows packed in plan order, each sequence's
                                 [pending tokens..., d_1..d_k], through the target once; logit
                                 rows only where a sequence samples (last pending row + drafts)
  verify(plan, drafts, out)      per sampling sequence: accepted drafts + one recovered/bonus
                                 (leniently inside a reasoning block where the request or model
                                 asks for relaxed acceptance: speculation/relaxed.py)
  commit(item, ...)              cache.commit(length + fed + accepted) (rollback of the rejected
                                 rows is this commit) and drafter.commit(tokens, hidden)
Nothing is committed before `commit`, so a failure in the first three leaves every cache and
request as it was (the engine then retries the sequences one by one to find the culprit).
Drafters that read hidden states get exactly the rows that ran and were kept: all prompt rows
after the last prefill chunk (collected chunk by chunk), the fed token + accepted drafts after
a verify; post-final-norm rows, or the outputs of the target layers the drafter lists in
`hidden_layers` (the forward returns the union of the step's drafters' layers).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from quickdraft.engine.scheduler import ScheduledSeq, StepPlan
from quickdraft.engine.sequence import Sequence
from quickdraft.image_encoder import ImageEncoder
from quickdraft.images import ImageRows, pack_image_rows
from quickdraft.models.base import LanguageModel, SequenceCache
from quickdraft.speculation.drafters.base import Draft, Drafter, DraftJob
from quickdraft.speculation.logits import token_logprobs
from quickdraft.speculation.relaxed import ThinkScan, ThinkTokens, lenient_rows
from quickdraft.speculation.verify import Verdict, relaxed_ok, verify

NO_DRAFT = Draft([])


@dataclass(slots=True)
class StepOutput:
    logits: Tensor  # [sampled rows, vocab]: per sampling sequence its last pending row + drafts
    hidden: Tensor | None  # [rows of the step, hidden] post-final-norm, if a drafter needs it
    row_start: list[int]  # per plan item: its first row in the packed batch
    logit_start: list[int]  # per plan item: its first row in `logits` (-1: does not sample)
    layers: Tensor | None = None  # [rows, len(layer_ids), hidden] tapped layer outputs
    layer_ids: tuple[int, ...] = ()  # the target layers in `layers`, in order
    # per plan item: its first prompt-scoring row in `logits` and their count (-1, 0: none)
    prompt_rows: list[tuple[int, int]] = field(default_factory=list)

    def hidden_rows(self, drafter: Drafter, start: int, n: int) -> Tensor:
        """The rows [start, start + n) as `drafter` reads them: post-final-norm `[n, hidden]`,
        or its `hidden_layers`' outputs concatenated `[n, len(hidden_layers) * hidden]`."""
        if not drafter.hidden_layers:
            assert self.hidden is not None
            return self.hidden[start : start + n]
        assert self.layers is not None
        picks = [self.layer_ids.index(i) for i in drafter.hidden_layers]
        return self.layers[start : start + n, picks].flatten(1)  # a copy: the step's is freed


class SpecCycle:
    def __init__(
        self,
        model: LanguageModel,
        think: ThinkTokens | None = None,
        encoder: ImageEncoder | None = None,
    ) -> None:
        """`think`: the model's reasoning-block markers (None: nothing is ever relaxed);
        `encoder`: a vision-language target's image encoder (None: text only)."""
        self.model = model
        self.think = think
        self.encoder = encoder

    def propose(self, plan: StepPlan) -> list[Draft]:
        """Drafts per plan item (NO_DRAFT where k = 0); one propose call per drafter."""
        drafts = [NO_DRAFT] * len(plan.items)
        groups: dict[int, tuple[Drafter, list[int]]] = {}
        for idx, item in enumerate(plan.items):
            if item.k > 0:
                assert item.seq.spec is not None
                drafter = item.seq.spec.drafter
                groups.setdefault(id(drafter), (drafter, []))[1].append(idx)
        for drafter, idxs in groups.values():
            jobs = []
            for idx in idxs:
                item = plan.items[idx]
                seq = item.seq
                tokens = seq.request.all_ids
                params = seq.request.params
                assert seq.spec is not None
                state, gen = seq.spec.draft_state, seq.rng.generator
                jobs.append(
                    DraftJob(
                        state,
                        tokens,
                        item.k,
                        params,
                        gen,
                        seq.controls,
                        item.min_prob,
                        seq.request.images,
                        seq.cache,
                    )
                )
            for idx, draft in zip(idxs, drafter.propose(jobs), strict=True):
                drafts[idx] = _constrain(draft, plan.items[idx])
        self._shadow(plan)
        return drafts

    def _shadow(self, plan: StepPlan) -> None:
        """Requests with several drafters: the free lookups that did not draft this step
        draft beside it (`Arm.shadow`; nothing is verified), so their acceptance is learnt every
        decode step, also while the policy drafts nothing."""
        for item in plan.items:
            seq, spec = item.seq, item.seq.spec
            if spec is None or len(spec.arms) == 1 or not (item.samples and seq.decoding):
                continue
            for arm in spec.arms:
                drafter = arm.speculation.drafter
                if (arm is spec.arm and item.k > 0) or arm.speculation.draft_cost is not None:
                    continue
                job = DraftJob(
                    arm.draft_state,
                    seq.request.all_ids,
                    spec.config.num_draft_tokens,
                    seq.request.params,
                    seq.rng.generator,
                )
                arm.shadow = drafter.propose([job])[0].tokens

    def forward(self, plan: StepPlan, drafts: list[Draft]) -> StepOutput:
        ids: list[int] = []
        caches: list[SequenceCache] = []
        num_new: list[int] = []
        logit_rows: list[int] = []
        row_start: list[int] = []
        logit_start: list[int] = []
        want_hidden = False
        taps: set[int] = set()  # target layers some drafter reads
        scored: list[tuple[int, int]] = []  # per item: its prompt-scoring rows (first, count)
        for item, draft in zip(plan.items, drafts, strict=True):
            seq = item.seq
            assert seq.cache is not None, "a scheduled sequence holds a cache"
            start = seq.num_computed
            fed = seq.request.all_ids[start : start + item.num_tokens]
            row_start.append(len(ids))
            if item.samples:
                logit_start.append(len(logit_rows))
                last = len(ids) + len(fed) - 1
                logit_rows.extend(range(last, last + 1 + len(draft.tokens)))
            else:
                logit_start.append(-1)
            scored.append(self._prompt_rows(seq, len(ids), len(fed)))
            want_hidden |= seq.request.params.pooling is not None
            ids.extend(fed)
            ids.extend(draft.tokens)
            caches.append(seq.cache)
            num_new.append(len(fed) + len(draft.tokens))
            drafter = seq.spec.drafter if seq.spec is not None else None
            if drafter is not None and drafter.needs_hidden:
                taps.update(drafter.hidden_layers)
                want_hidden |= not drafter.hidden_layers
        prompt_rows = []  # the prompt rows that score their next prompt token, after the rest
        for first, n in scored:
            prompt_rows.append((len(logit_rows), n) if n else (-1, 0))
            logit_rows.extend(range(first, first + n))
        device = self.model.device
        rows = torch.tensor(logit_rows or [len(ids) - 1], device=device)
        layer_ids = tuple(sorted(taps))
        out = self.model(
            torch.tensor(ids, device=device),  # [N]
            caches,
            num_new,
            logit_rows=rows,
            return_hidden=want_hidden,
            hidden_layers=layer_ids,
            images=self._images(plan, num_new),
        )
        return StepOutput(
            out.logits, out.hidden, row_start, logit_start, out.layers, layer_ids, prompt_rows
        )

    @staticmethod
    def _prompt_rows(seq: Sequence, first: int, fed: int) -> tuple[int, int]:
        """(first packed row, count) of the fed rows whose next token is a prompt token, for a
        request that asks for its prompt's logprobs; (0, 0) for any other."""
        if seq.request.params.prompt_logprobs is None:
            return 0, 0
        start, prompt = seq.num_computed, len(seq.request.prompt_ids)
        return first, max(0, min(fed, prompt - 1 - start))

    def _images(self, plan: StepPlan, num_new: list[int]) -> ImageRows | None:
        """The forward's image rows and M-RoPE positions (None: no sequence has images); the
        images of a prompt whose rows run now are encoded first (or found by digest)."""
        layouts = [item.seq.request.images for item in plan.items]
        if all(layout is None for layout in layouts):
            return None
        assert self.encoder is not None, "a request with images needs a vision-language target"
        starts = [item.seq.num_computed for item in plan.items]
        for layout, start in zip(layouts, starts, strict=True):
            if layout is not None and start < layout.positions.shape[1]:
                self.encoder.fill(layout)
        hidden = self.model.config.hidden_size
        return pack_image_rows(layouts, starts, num_new, hidden, self.model.device)

    def verify(self, plan: StepPlan, drafts: list[Draft], out: StepOutput) -> list[Verdict | None]:
        verdicts: list[Verdict | None] = []
        for item, draft, lo in zip(plan.items, drafts, out.logit_start, strict=True):
            if lo < 0:
                verdicts.append(None)
                continue
            seq = item.seq
            params = seq.request.params
            raw = out.logits[lo : lo + 1 + len(draft.tokens)]  # [k + 1, vocab]
            ctl = seq.controls
            logits = raw if ctl is None else ctl.apply(raw, draft.tokens)
            position = len(seq.request.output_ids)
            lenient = self._lenient(item, draft.tokens, logits)
            verdict = verify(
                draft.tokens, draft.p_draft, logits, params, seq.rng, position, lenient
            )
            if params.logprobs is not None:
                rows = raw[: len(verdict.tokens)]  # row i chose token i
                verdict.logprobs = token_logprobs(rows, verdict.tokens, params.logprobs)
            verdicts.append(verdict)
        return verdicts

    def _lenient(self, item: ScheduledSeq, draft: list[int], logits: Tensor) -> list[bool] | None:
        """Per draft position, whether relaxed acceptance may keep it (None: strict): the
        request's `relaxed_thinking`, else its model's, and only inside a reasoning block."""
        seq, think = item.seq, self.think
        if not draft or seq.spec is None or think is None:
            return None
        relaxed = seq.request.params.relaxed_thinking
        if relaxed is None:
            relaxed = seq.spec.config.relaxed_thinking
        if relaxed is None or not relaxed.enabled:
            return None
        if seq.spec.think is None:
            seq.spec.think = ThinkScan(think)
        rows = lenient_rows(seq.spec.think.inside(seq.request.all_ids), draft, think)
        return relaxed_ok(draft, logits, rows, relaxed.top_k, relaxed.delta)

    def commit(
        self, item: ScheduledSeq, verdict: Verdict | None, out: StepOutput, idx: int
    ) -> None:
        """Keep the fed tokens and the accepted drafts in the cache (item `idx` of the step's
        plan); record the prompt rows' logprobs where asked; sync the drafter."""
        seq, row_start = item.seq, out.row_start[idx]
        assert seq.cache is not None
        first, n = out.prompt_rows[idx] if out.prompt_rows else (-1, 0)
        if n:  # row i scores the prompt token after it
            req, start = seq.request, seq.num_computed
            nxt = req.prompt_ids[start + 1 : start + 1 + n]
            top = req.params.prompt_logprobs or 0
            rows = out.logits[first : first + n]
            req.prompt_logprobs += token_logprobs(rows, nxt, top, ranks=True)
        if seq.request.params.pooling is not None:
            assert out.hidden is not None
            pool(seq, out.hidden[row_start : row_start + item.num_tokens])
        kept = item.num_tokens + (verdict.accepted if verdict is not None else 0)
        seq.cache.commit(seq.cache.length + kept)
        if verdict is not None and seq.controls is not None:
            seq.controls.commit(verdict.tokens)
        spec = seq.spec
        if spec is None:
            return
        hidden = None
        if spec.drafter.needs_hidden:
            rows = out.hidden_rows(spec.drafter, row_start, kept)  # [kept, hidden (x taps)]
            if verdict is None:  # a prefill chunk: the drafter hears of it after the last one
                spec.prompt_hidden.append(rows)
                return
            if spec.prompt_hidden:
                rows = torch.cat([*spec.prompt_hidden, rows])
                spec.prompt_hidden.clear()
            hidden = rows
        if verdict is not None:
            spec.drafter.commit(spec.draft_state, seq.request.all_ids + verdict.tokens, hidden)


def pool(seq: Sequence, rows: Tensor) -> None:
    """Pool the prompt rows among `rows` (the step's post-final-norm rows of `seq`, from
    position `seq.num_computed`) into `request.embedding` as its `pooling` says. "mean" adds
    the rows one by one in prompt order, in fp32, so its bits do not depend on how the prompt
    was cut into chunks (nor on what else the steps ran), and divides once at the last."""
    req = seq.request
    start, prompt = seq.num_computed, len(req.prompt_ids)
    rows = rows[: max(0, prompt - start)].float()
    if not len(rows):
        return
    how, last = req.params.pooling, start + len(rows) == prompt
    if how == "cls" and start == 0:
        req.embedding = rows[0].clone()
    elif how == "last" and last:
        req.embedding = rows[-1].clone()
    elif how == "mean":
        acc = torch.zeros_like(rows[0]) if req.embedding is None else req.embedding
        for row in rows:
            acc = acc + row
        req.embedding = acc / prompt if last else acc


def _constrain(draft: Draft, item: ScheduledSeq) -> Draft:
    """The draft up to the first token the request's grammar refuses (verify would reject it),
    then, up to k, the tokens the grammar forces next (one-hot: certain under the grammar)."""
    controls = item.seq.controls
    if controls is None or controls.matcher is None:
        return draft
    n = controls.cut(draft.tokens)
    tokens = draft.tokens[:n]
    p_draft = None if draft.p_draft is None else draft.p_draft[:n]
    forced = controls.forced(tokens, item.k - n)
    if forced and p_draft is not None:  # a drafted distribution: forced rows are one-hot
        one_hot = torch.zeros(len(forced), p_draft.shape[-1], dtype=p_draft.dtype)
        one_hot[torch.arange(len(forced)), torch.tensor(forced)] = 1.0
        p_draft = torch.cat([p_draft, one_hot])
    if n == len(draft.tokens) and not forced:
        return draft
    return Draft(tokens + forced, p_draft)
