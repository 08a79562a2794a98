# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DDTree's structured-output requests: the scheduler's side.

vLLM checks a request's drafts against its grammar as a chain, which a DDTree
tree in node order is not, so DDTree decodes structured-output requests without
drafts. The scheduler records them as they are added and, before each step is
sized, clears their drafts (:func:`drop_grammar_drafts`): each is then scheduled
as one token, and its grammar masks one logit row.
"""

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.request import Request


def drop_grammar_drafts(
    grammar_req_ids: set[str], requests: Mapping[str, "Request"]
) -> None:
    """Clear the draft tokens (the worker's drafts, or the async scheduler's
    placeholders for them) of the structured-output requests in
    ``grammar_req_ids``; the ids of requests finished or gone are removed."""
    for req_id in list(grammar_req_ids):
        request = requests.get(req_id)
        if request is None or request.is_finished():
            grammar_req_ids.discard(req_id)
        elif request.spec_token_ids:
            request.spec_token_ids = []
