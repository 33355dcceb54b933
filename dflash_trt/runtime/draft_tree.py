"""Draft trees over a DFlash block: verify several candidates per position in one target pass.

A DFlash drafter predicts every block position in one pass, each from the context and the mask
tokens, not from the drafts before it (DFlash paper sec. 3.2). Its positions are independent
marginals, as Medusa's heads are (Cai et al. 2024, "Medusa", sec. 2.1.2, tree attention). So the
top-k tokens of each position combine into a tree of candidate continuations, and the target
verifies all of its nodes in one pass with a tree attention mask: each node attends to the
committed context, its ancestors and itself. Greedy verification then keeps the longest path whose
every token is the target's argmax after its parent, which is exactly the target's greedy output,
like the chain's.

Which nodes: the tree holds the candidates with the largest products of the drafter's probabilities
along their path (EAGLE-2's rule, Li et al. 2024, sec. 4: the drafter's confidence approximates
the acceptance rate), at most `max_nodes`, and with a threshold only those whose product is at
least that. The chain of top-1 drafts is the special case k = 1.

Layout (per row, padded to the batch's largest tree): node 0 is the block's first token (the last
verified one), nodes 1..m the drafts; `parents[i]` is the node index of the parent of node i + 1
(always < i + 1: a parent is chosen before its children), the node's depth is its position offset,
and node i is written to KV-cache slot start + i. After verification the accepted path's K/V move
to slots start .. start + L (`KVCache.move`).
"""

from __future__ import annotations

import heapq

import torch


def build_tree(probs: list[list[float]], ids: list[list[int]], max_nodes: int,
               threshold: float = 0.0) -> tuple[list[int], list[int]]:
    """Choose one row's draft tree, best first by the product of draft probabilities.

    Args:
        probs: [D][k] the drafter's top-k probabilities at each of the D draft positions, each list
            in decreasing order.
        ids: [D][k] the matching token ids.
        max_nodes: at most this many draft nodes (the root, the last verified token, is extra).
        threshold: in [0, 1): only nodes whose path product is >= threshold (0: no threshold).
    Returns:
        (tokens, parents): m <= max_nodes draft tokens in the order chosen (a node's parent comes
        before it) and the parent node index of each (0: the root; node i is tokens[i - 1]).
    """
    if not probs or max_nodes <= 0:
        return [], []
    depth_k = len(probs[0])
    tokens: list[int] = []
    parents: list[int] = []
    # heap entries: (-score, depth, choice, parent node); a node's first child and next sibling
    # are pushed when it is taken, so the heap holds at most two entries per taken node
    heap = [(-probs[0][0], 0, 0, 0)]
    while heap and len(tokens) < max_nodes:
        neg, d, c, parent = heapq.heappop(heap)
        score = -neg
        if score <= 0.0 or score < threshold:
            break  # every entry left scores at most this
        tokens.append(ids[d][c])
        parents.append(parent)
        node = len(tokens)
        if d + 1 < len(probs):
            heapq.heappush(heap, (-score * probs[d + 1][0], d + 1, 0, node))
        if c + 1 < depth_k and probs[d][c] > 0:
            heapq.heappush(heap, (-score / probs[d][c] * probs[d][c + 1], d, c + 1, parent))
    return tokens, parents


def add_path(tokens: list[int], parents: list[int], path: list[int], max_nodes: int) -> tuple[list[int], list[int]]:
    """Merge one candidate continuation into a row's draft tree (e.g. a prompt-lookup match,
    `dflash_trt.runtime.prompt_lookup`), within a node budget.

    The path's leading tokens that the tree already holds along one branch reuse those nodes; the
    rest become a chain under the last of them. When the budget is short, the tree's LAST chosen
    nodes make room (a best-first tree stays a tree when cut after any node: a parent comes before
    its children), as few as needed; the path itself is cut to max_nodes.

    Args:
        tokens / parents: the tree as `build_tree` returns it.
        path: the candidate tokens for block positions 1, 2, ... (target ids).
        max_nodes: at most this many draft nodes in the result.
    Returns:
        (tokens, parents) of the merged tree (new lists).
    """
    path = path[:max_nodes]
    for keep in range(len(tokens), -1, -1):
        children: dict[tuple[int, int], int] = {}
        for i in range(keep):
            children.setdefault((parents[i], tokens[i]), i + 1)
        node, shared = 0, 0
        for tok in path:
            child = children.get((node, tok))
            if child is None:
                break
            node, shared = child, shared + 1
        new = path[shared:]
        if keep + len(new) <= max_nodes:
            out_tokens, out_parents = tokens[:keep] + new, parents[:keep]
            for j in range(len(new)):
                out_parents.append(node if j == 0 else keep + j)
            return out_tokens, out_parents
    raise AssertionError("unreachable: keep = 0 always fits the cut path")


def chain_parents(n: int, k: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[n, k] int64 parents of a chain of k drafts (node i + 1's parent is node i)."""
    return torch.arange(k, device=device).expand(n, k).clone()


def node_depths(parents: torch.Tensor) -> torch.Tensor:
    """[n, k + 1] int64 depth of every node (root 0) from parents [n, k] (parent index < node index)."""
    depths = []
    for row in parents.tolist():  # host lists: k tiny device ops per step would cost more (GPU launches)
        d = [0]
        for parent in row:
            d.append(d[parent] + 1)
        depths.append(d)
    return torch.tensor(depths, dtype=torch.int64, device=parents.device)


def ancestor_matrix(parents: torch.Tensor) -> torch.Tensor:
    """bool [n, k + 1, k + 1]: entry (i, j) is True when node j is node i or one of its ancestors."""
    k = parents.shape[1]
    rows = []
    for row in parents.tolist():
        bits = [1]  # node i's ancestors-or-self as a bit mask; parents come first
        for i, parent in enumerate(row):
            bits.append(bits[parent] | 1 << (i + 1))
        rows.append([[bool(b >> j & 1) for j in range(k + 1)] for b in bits])
    return torch.tensor(rows, dtype=torch.bool, device=parents.device).view(-1, k + 1, k + 1)


def tree_attention_mask(parents: torch.Tensor, starts: torch.Tensor, kv_len: int) -> torch.Tensor:
    """The target's attention mask for verifying draft trees.

    Args:
        parents: [n, k] int64 (module docstring); rows with fewer nodes pad with any parents.
        starts: [n] int64 slot of each row's root (= its committed length); node i sits at slot
            starts + i.
        kv_len: host int, the number of cache slots attention reads (>= starts.max() + k + 1).
    Returns:
        bool [n, 1, k + 1, kv_len]: node i of row r attends to slots < starts[r] (the context) and
        to the slots of its ancestors and itself.
    """
    n, k = parents.shape
    dev = parents.device
    key = torch.arange(kv_len, device=dev)
    mask = (key[None, None, :] < starts[:, None, None]).expand(n, k + 1, kv_len).clone()
    anc = ancestor_matrix(parents)
    cols = starts[:, None] + torch.arange(k + 1, device=dev)  # [n, k + 1] slots of the nodes
    mask.scatter_(2, cols[:, None, :].expand(n, k + 1, k + 1), anc)
    return mask[:, None]


def greedy_tree_accept(tokens: list[int], parents: list[int], num_nodes: int,
                       posterior: list[int]) -> tuple[list[int], int]:
    """Greedy verification of one row's tree.

    Args:
        tokens: the row's draft tokens (node i is tokens[i - 1]); only the first num_nodes count.
        parents: their parent node indices.
        num_nodes: how many drafts of the row are verified.
        posterior: the target's argmax at every node [0 .. num_nodes] (root first).
    Returns:
        (path, next_token): the accepted nodes (node indices, root excluded, in depth order) and
        the target's argmax after the last of them (the bonus or correction token).
    """
    children: dict[int, dict[int, int]] = {}
    for i in range(num_nodes):
        children.setdefault(parents[i], {}).setdefault(tokens[i], i + 1)  # first node wins a duplicate
    path: list[int] = []
    node = 0
    while True:
        nxt = children.get(node, {}).get(posterior[node])
        if nxt is None:
            return path, posterior[node]
        path.append(nxt)
        node = nxt
