"""A radix tree (compressed trie) over token-id sequences with opaque values: the index half of
the prefix cache, after SGLang's RadixAttention (Zheng et al. 2024, "SGLang: Efficient
Execution of Structured Language Model Programs", §3).

Each node owns an edge of tokens (``key``) and one value covering exactly those tokens (for the
KV pool: their keys and values). A root-to-node path spells a cached prefix. The tree knows
nothing about tensors: values are opaque, and the only thing it asks of them is a ``split``
function, called when an edge is cut in two (``split(value, k)`` -> the values of the first
``k`` tokens and of the rest).

Recency is a logical clock (one tick per `match` / `insert`), not wall time, so eviction order
is deterministic and testable (ties go to the older node). Reference counts pin a matched path:
`lock` increments every node from the root to the match, so a locked node's ancestors are
locked too, and `evict` only removes unlocked leaves, least recently used first, re-examining a
parent once it becomes a leaf.

Eviction costs what it frees, not the size of the tree: as in SGLang, the tree keeps the set
of evictable leaves (unreferenced, childless) and the count of evictable tokens up to date as
nodes are inserted, split, locked, unlocked and removed, and a heap of those leaves by recency.
A touch (`match`, `insert`) pushes a fresh heap entry instead of reordering the heap; an entry
whose node has been touched since, locked, or grown a child is skipped when popped (lazy
deletion), and the heap is rebuilt from the leaf set when stale entries outnumber live ones.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from metaloom.errors import InvalidParameter

V = TypeVar("V")


class Node(Generic[V]):
    """One edge of the tree. ``key`` is empty only at the root (whose value is ``None``)."""

    __slots__ = ("children", "key", "last_used", "parent", "refs", "serial", "value")

    def __init__(self, key: tuple[int, ...], value: V | None, parent: Node[V] | None, last_used: int,
                 serial: int = 0) -> None:
        self.key = key
        self.value = value
        self.parent = parent
        self.children: dict[int, Node[V]] = {}  # first token of the child's key -> child
        self.refs = 0
        self.last_used = last_used
        self.serial = serial  # creation order: breaks recency ties (older first)

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def tokens(self) -> tuple[int, ...]:
        """The full prefix this node ends: the keys from the root down to here."""
        parts: list[tuple[int, ...]] = []
        node: Node[V] | None = self
        while node is not None:
            parts.append(node.key)
            node = node.parent
        return tuple(t for part in reversed(parts) for t in part)


@dataclass(frozen=True)
class Match(Generic[V]):
    """The longest cached prefix of a query: ``length`` tokens, ending inside or at the end of
    ``node`` (the root when nothing matched). Only the deepest node is kept: the path is read
    through parent links, so a later split of an edge on it (which inserts a node between)
    leaves the match, its spans and its lock consistent. Valid while locked, or until the next
    `evict`."""

    length: int
    node: Node[V]

    @property
    def path(self) -> tuple[Node[V], ...]:
        """The nodes below the root down to ``node``, root side first."""
        out = []
        node: Node[V] | None = self.node
        while node is not None and node.parent is not None:
            out.append(node)
            node = node.parent
        return tuple(reversed(out))

    def spans(self) -> Iterator[tuple[V, int]]:
        """(value, tokens of it in the prefix) for each node of the path; the last node may be
        used only partly."""
        left = self.length
        for node in self.path:
            take = min(left, len(node.key))
            assert node.value is not None
            yield node.value, take
            left -= take


@dataclass(frozen=True)
class Evicted(Generic[V]):
    tokens: int  # length of the evicted node's key
    value: V


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    if tuple(a[:n]) == tuple(b[:n]):  # the common case (a whole edge matches), at C speed
        return n
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class RadixTree(Generic[V]):
    """Token prefixes -> values. ``size`` is the total number of tokens held (the sum of the
    key lengths of all nodes), which is what a memory budget counts."""

    def __init__(self, split: Callable[[V, int], tuple[V, V]]) -> None:
        self._split = split
        self._clock = 0
        self._serial = 0
        self.root: Node[V] = Node((), None, None, 0)
        self.size = 0
        self._evictable = 0  # tokens in unreferenced nodes
        self._leaves: set[Node[V]] = set()  # unreferenced leaves: what `evict` may remove next
        self._heap: list[tuple[int, int, Node[V]]] = []  # (last_used, serial, leaf); stale entries skipped

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _node(self, key: tuple[int, ...], value: V | None, parent: Node[V], last_used: int) -> Node[V]:
        self._serial += 1
        return Node(key, value, parent, last_used, self._serial)

    def _refresh(self, node: Node[V]) -> None:
        """Bring ``node``'s place among the evictable leaves up to date after its children,
        references or recency changed (a new heap entry where it is, or stays, one)."""
        evictable = node.parent is not None and not node.children and node.refs == 0
        if not evictable:
            self._leaves.discard(node)
            return
        self._leaves.add(node)
        heapq.heappush(self._heap, (node.last_used, node.serial, node))
        if len(self._heap) > 2 * len(self._leaves) + 64:  # mostly stale: rebuild, O(leaves)
            self._heap = [(n.last_used, n.serial, n) for n in self._leaves]
            heapq.heapify(self._heap)

    def nodes(self) -> Iterator[Node[V]]:
        """Every node below the root, depth first."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def match(self, tokens: Sequence[int]) -> Match[V]:
        """The longest prefix of ``tokens`` present in the tree; marks its path as used now."""
        now = self._tick()
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            j = common_prefix(child.key, tokens[pos:pos + len(child.key)])
            child.last_used = now
            node, pos = child, pos + j
            if j < len(child.key):
                break
        if node in self._leaves:  # its recency changed: a fresh heap entry
            self._refresh(node)
        return Match(pos, node)

    def insert(self, tokens: Sequence[int], value: V, offset: int = 0) -> int:
        """Store ``tokens``, with ``value`` covering ``tokens[offset:]``; return how many tokens
        were new. Tokens already present keep their old value (the new one is split off and
        dropped for that part), so ``offset`` may be anything up to the present prefix length.

        Raises `InvalidParameter` if ``offset`` passes the present prefix: the tokens between
        would have no value.
        """
        now = self._tick()
        node, pos = self.root, 0
        key = tuple(tokens)
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            j = common_prefix(child.key, key[pos:pos + len(child.key)])
            if j < len(child.key):
                child = self._split_node(child, j)
            child.last_used = now
            node, pos = child, pos + j
        if node in self._leaves:  # touched: a fresh heap entry
            self._refresh(node)
        if offset > pos:
            raise InvalidParameter("offset", offset, f"at most the cached prefix length {pos} of these tokens")
        if pos == len(key):
            return 0
        if pos > offset:
            _, value = self._split(value, pos - offset)
        leaf = self._node(key[pos:], value, node, now)
        node.children[key[pos]] = leaf
        self.size += len(leaf.key)
        self._evictable += len(leaf.key)
        self._refresh(node)  # no longer a leaf
        self._refresh(leaf)
        return len(leaf.key)

    def _split_node(self, child: Node[V], k: int) -> Node[V]:
        """Cut ``child``'s edge after ``k`` tokens; return the new upper node. The upper node
        inherits the reference count: every lock through ``child`` passed through it."""
        assert child.parent is not None and 0 < k < len(child.key) and child.value is not None
        head, tail = self._split(child.value, k)
        # the tokens move between the two nodes, which share a reference count: the evictable
        # count is unchanged, and ``child`` stays the leaf (or inner node) it was
        upper = self._node(child.key[:k], head, child.parent, child.last_used)
        upper.refs = child.refs
        child.parent.children[child.key[0]] = upper
        child.key, child.value, child.parent = child.key[k:], tail, upper
        upper.children[child.key[0]] = child
        return upper

    def lock(self, match: Match[V]) -> None:
        """Pin the matched path (the deepest node and all its ancestors) against eviction."""
        for node in match.path:
            node.refs += 1
            if node.refs == 1:
                self._evictable -= len(node.key)
                self._leaves.discard(node)

    def unlock(self, match: Match[V]) -> None:
        path = match.path
        # an evicted node is detached (no parent): its match cannot still hold a lock
        detached = match.node is not self.root and match.node.parent is None
        if detached or any(node.refs <= 0 for node in path):
            raise InvalidParameter("match", match.length, "a locked match (unlock once per lock)")
        for node in path:
            node.refs -= 1
            if node.refs == 0:
                self._evictable += len(node.key)
                self._refresh(node)

    def evictable(self) -> int:
        """Tokens that `evict` could free now: nodes with no reference (their subtrees are
        unreferenced too, since references count along whole paths). Kept up to date: O(1)."""
        return self._evictable

    def evict(self, tokens: int) -> list[Evicted[V]]:
        """Remove unreferenced leaves, least recently used first, until at least ``tokens``
        tokens are freed or nothing unreferenced is left. Returns what was removed, in order.
        Costs O((removed + stale heap entries) · log leaves): never a walk of the tree."""
        freed, out = 0, []
        while freed < tokens and self._heap:
            used, _, leaf = heapq.heappop(self._heap)
            if leaf not in self._leaves or used != leaf.last_used:
                continue  # stale: touched, locked or grown a child since it was pushed
            parent = leaf.parent
            assert parent is not None and leaf.value is not None
            self._leaves.discard(leaf)
            del parent.children[leaf.key[0]]
            leaf.parent = None
            self.size -= len(leaf.key)
            self._evictable -= len(leaf.key)
            freed += len(leaf.key)
            out.append(Evicted(len(leaf.key), leaf.value))
            if parent is not self.root:
                self._refresh(parent)  # an unreferenced parent left childless is a leaf now
        return out
