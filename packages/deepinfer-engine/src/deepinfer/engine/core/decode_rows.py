"""The engine's per-row state of a steady decode step: the same requests, in the same order, step
after step (issue #17, persistent step state).

While the decode rows do not change, `SteadyRows` keeps what every step needs of them: the rows'
sampling parameters (`StepRows`, so `SamplingStage` reuses its `SamplingBatch`), each row's output
count, and the per-row limits that decide whether a sampled token may end its request. Post-processing
then splits a step's rows in a few vectorised passes (`take_tokens`): the rows whose token cannot end
the request and that report nothing per step (FINAL_ONLY, no stop strings, no logprobs) get their
token appended here, in bulk; only the others (a possible stop or length end, a request that ended
since the step was launched, a row that reports per step) go through the engine's per-row path.
"""

from __future__ import annotations

from itertools import compress
from operator import attrgetter

import numpy as np

from ..sampling.sampling_stage import StepRows
from .request import Request

_finish_reason = attrgetter("finish_reason")
_FEW_STOP_IDS = 8


class SteadyRows:
    """The rows of one decode step's requests, reused while the next steps have the same ones.

    Args:
        generation: the step's `DecodeBatch.rows_generation`; later steps of the same generation
            have the same rows (the scheduler starts a new one whenever a row or an id changes).
        reqs: the request of each row.
        rows: the rows' sampling parameters; must not be constrained (no grammar) or controlled.
    """

    def __init__(self, generation: int, reqs: list[Request], rows: StepRows) -> None:
        if rows.grammars is not None or rows.controlled:
            raise ValueError("constrained or controlled rows change every step; they are not steady")
        self.generation = generation
        self.reqs = reqs
        self._params, self._rngs = rows.params, rows.rngs
        num_rows = len(reqs)
        # Each request's one token list (`Request.token_ids`: prompt + outputs, which the scheduler
        # reads in place); the scheduler is handed the tokens appended here afterwards.
        self._token_lists = [r.token_ids for r in reqs]
        self._num_prompt = np.fromiter(map(attrgetter("num_prompt_tokens"), reqs), np.int64, num_rows)
        # output tokens per row; exact for every row whose request has not ended
        self.num_out = np.fromiter(map(len, self._token_lists), np.int64, num_rows) - self._num_prompt
        self._max_tokens = np.fromiter(map(attrgetter("max_tokens"), reqs), np.int64, num_rows)
        self._min_tokens = np.fromiter(map(attrgetter("min_tokens"), reqs), np.int64, num_rows)
        self._per_row = ~np.fromiter(map(attrgetter("plain_decode"), reqs), np.bool_, num_rows)
        self._all_per_row = bool(self._per_row.all())
        self._all_rows = np.arange(num_rows)
        stop_ids = frozenset().union(*map(attrgetter("stop_token_ids"), reqs))
        self._stop_ids = np.array(sorted(stop_ids), dtype=np.int64)
        self.ones = np.ones(num_rows, dtype=np.int64)      # one accepted token per row (`append_decode_tokens`)

    def step_rows(self) -> StepRows:
        """The sampling parameters of the next step of these rows (output counts as of now)."""
        return StepRows(self._params, self._rngs, self.num_out.tolist())

    def take_tokens(self, token_array: np.ndarray, token_ids: list[int], *, maybe_ended: bool = True) -> np.ndarray:
        """Append one sampled token per row to the requests that cannot end with it and report nothing
        per step; return the other rows (ascending), which the caller must post-process one by one
        and then `resync`.

        Args:
            token_array: [num_rows] int64 sampled token ids; token_ids: the same as a list.
            maybe_ended: whether a request of these rows may have ended since the step was launched
                (False: the caller knows none has, and the rows are not checked).
        """
        num_out = self.num_out
        num_out += 1
        if self._all_per_row:                      # every row reports per step: nothing to do in bulk
            return self._all_rows
        per_row = num_out >= self._max_tokens
        per_row |= self._per_row
        if len(self._stop_ids):
            if len(self._stop_ids) <= _FEW_STOP_IDS:     # a comparison each beats np.isin's sort
                stops = token_array == self._stop_ids[0]
                for stop_id in self._stop_ids[1:]:
                    stops |= token_array == stop_id
            else:
                stops = np.isin(token_array, self._stop_ids)
            per_row |= stops & (num_out >= self._min_tokens)
        if maybe_ended and any(map(_finish_reason, self.reqs)):   # ended since launched: the token is dropped
            per_row |= np.fromiter((r.finish_reason is not None for r in self.reqs), np.bool_, len(self.reqs))
        if not per_row.any():
            for tokens, token in zip(self._token_lists, token_ids):
                tokens.append(token)
            return per_row.nonzero()[0]
        for tokens, token in compress(zip(self._token_lists, token_ids), ~per_row):
            tokens.append(token)
        return per_row.nonzero()[0]

    def resync(self, rows: np.ndarray) -> None:
        """Reread the output counts of rows post-processed one by one."""
        if len(rows) > len(self.reqs) // 8:         # many: reread every row in one pass
            self.num_out[:] = np.fromiter(map(len, self._token_lists), np.int64, len(self.reqs))
            self.num_out -= self._num_prompt
            return
        for row in rows.tolist():
            self.num_out[row] = len(self._token_lists[row]) - self._num_prompt[row]
