"""The radix tree against a reference model (a set of stored prefixes), with hypothesis.

Values are the tokens themselves (split by slicing), so every node must satisfy
``value == key`` and a match's spans must spell the matched prefix: a wrong split shows up.
"""

import heapq

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from metaloom.errors import InvalidParameter
from metaloom.prefix.radix import RadixTree


def _split(value, k):
    return value[:k], value[k:]


def _tree():
    return RadixTree(_split)


# a small alphabet and short sequences make shared prefixes and edge splits frequent
seqs = st.lists(st.integers(0, 3), min_size=0, max_size=12).map(tuple)


def _expected_evictions(tree, tokens):
    """What `evict(tokens)` must remove, found the slow way (every node walked, as the tree did
    before it kept its evictable leaves): unreferenced leaves by (last use, creation order), a
    parent joining once its last child is gone."""
    children = {id(n): len(n.children) for n in tree.nodes()}
    heap = [(n.last_used, n.serial, n) for n in tree.nodes() if n.is_leaf and n.refs == 0]
    heapq.heapify(heap)
    out, freed = [], 0
    while freed < tokens and heap:
        _, _, leaf = heapq.heappop(heap)
        out.append(leaf.value)
        freed += len(leaf.key)
        parent = leaf.parent
        if parent is not tree.root:
            children[id(parent)] -= 1
            if children[id(parent)] == 0 and parent.refs == 0:
                heapq.heappush(heap, (parent.last_used, parent.serial, parent))
    return out


def _common(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class RadixMachine(RuleBasedStateMachine):
    @initialize()
    def start(self):
        self.tree = _tree()
        self.present = {()}  # every prefix the tree holds (closed under taking prefixes)
        self.locks = []  # (query, match) pairs currently locked

    def _paths(self):
        return {node.tokens() for node in self.tree.nodes()}

    @rule(key=seqs)
    def insert(self, key):
        m = self.tree.match(key).length
        added = self.tree.insert(key, key[m:], offset=m)
        assert added == len(key) - m
        self.present |= {key[:i] for i in range(len(key) + 1)}

    @rule(key=seqs, offset=st.integers(0, 12))
    def insert_with_any_valid_offset(self, key, offset):
        m = self.tree.match(key).length
        if offset > min(m, len(key)):
            with pytest.raises(InvalidParameter):
                self.tree.insert(key, key[offset:], offset=offset)
            return
        self.tree.insert(key, key[offset:], offset=offset)
        self.present |= {key[:i] for i in range(len(key) + 1)}

    @rule(query=seqs)
    def match_is_longest_present_prefix(self, query):
        m = self.tree.match(query)
        assert m.length == max(i for i in range(len(query) + 1) if query[:i] in self.present)
        spelled = tuple(t for value, take in m.spans() for t in value[:take])
        assert spelled == query[:m.length]

    @rule(query=seqs)
    def lock(self, query):
        m = self.tree.match(query)
        self.tree.lock(m)
        self.locks.append((query, m))

    @precondition(lambda self: self.locks)
    @rule(index=st.integers(0, 100))
    def unlock(self, index):
        _, m = self.locks.pop(index % len(self.locks))
        self.tree.unlock(m)

    @rule(tokens=st.integers(0, 30))
    def evict(self, tokens):
        before = {id(n): (n.tokens(), len(n.key), n.refs, n.last_used, n.is_leaf) for n in self.tree.nodes()}
        size, evictable = self.tree.size, self.tree.evictable()
        expected = _expected_evictions(self.tree, tokens)
        out = self.tree.evict(tokens)
        assert [e.value for e in out] == expected, "the order a full walk finds"
        freed = sum(e.tokens for e in out)
        gone = set(before) - {id(n) for n in self.tree.nodes()}
        assert sum(before[i][1] for i in gone) == freed == size - self.tree.size
        assert freed >= tokens or self.tree.evictable() == 0, "frees enough, or all it can"
        assert freed <= evictable
        assert all(before[i][2] == 0 for i in gone), "a referenced node is never evicted"
        if gone:
            # LRU: no unreferenced leaf older than the newest evicted one is left behind
            newest = max(before[i][3] for i in gone)
            assert all(before[i][3] >= newest for i in before
                       if i not in gone and before[i][4] and before[i][2] == 0)
        for i in gone:  # the reference model drops the evicted edges' prefixes
            path, k = before[i][0], before[i][1]
            self.present -= {path[:j] for j in range(len(path) - k + 1, len(path) + 1)}

    def _prefix_closure(self):
        return {path[:i] for path in self._paths() for i in range(len(path) + 1)}

    @invariant()
    def structure(self):
        if not hasattr(self, "tree"):
            return
        total = 0
        for node in self.tree.nodes():
            assert node.key, "only the root has an empty edge"
            assert node.value == node.key, "a value covers exactly its edge's tokens"
            assert node.parent.children[node.key[0]] is node
            assert node.refs >= 0 and (node.parent.parent is None or node.parent.refs >= node.refs)
            total += len(node.key)
        assert self.tree.size == total, "total size is the sum of the node sizes"
        assert self._prefix_closure() | {()} == self.present

    @invariant()
    def evictable_count_and_leaves_are_kept_up_to_date(self):
        if not hasattr(self, "tree"):
            return
        nodes = list(self.tree.nodes())
        assert self.tree.evictable() == sum(len(n.key) for n in nodes if n.refs == 0)
        assert self.tree._leaves == {n for n in nodes if n.is_leaf and n.refs == 0}
        assert len(self.tree._heap) <= 2 * len(self.tree._leaves) + 65, "stale entries are compacted"

    @invariant()
    def locked_prefixes_survive_and_refs_count_locks(self):
        if not hasattr(self, "tree"):
            return
        for query, m in self.locks:
            assert self.tree.match(query).length >= m.length
        expected = {}
        for _, m in self.locks:
            for node in m.path:
                expected[id(node)] = expected.get(id(node), 0) + 1
        for node in self.tree.nodes():
            assert node.refs == expected.get(id(node), 0)


TestRadixMachine = RadixMachine.TestCase
TestRadixMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])


@settings(max_examples=200, deadline=None)
@given(st.lists(seqs, max_size=8), seqs)
def test_match_returns_the_longest_common_prefix_with_any_inserted_sequence(keys, query):
    tree = _tree()
    for key in keys:
        tree.insert(key, key)
    best = max((_common(k, query) for k in keys), default=0)
    assert tree.match(query).length == best
    assert tree.size == len({k[:i] for k in keys for i in range(1, len(k) + 1)})


def test_split_keeps_a_lock_consistent_and_eviction_is_lru():
    tree = _tree()
    tree.insert((1, 2, 3, 4), (1, 2, 3, 4))
    locked = tree.match((1, 2, 3, 4, 9))
    tree.lock(locked)
    tree.insert((1, 2, 7), (1, 2, 7))  # splits the locked edge after (1, 2)
    assert [n.key for n in locked.path] == [(1, 2), (3, 4)] and all(n.refs == 1 for n in locked.path)
    assert tree.evict(100)[0].value == (7,)  # only the unlocked leaf can go
    assert tree.size == 4
    tree.unlock(locked)
    assert all(n.refs == 0 for n in tree.nodes())
    with pytest.raises(InvalidParameter):
        tree.unlock(locked)
    tree.insert((5,), (5,))
    tree.match((1, 2, 3))  # touch: (5,) is now the least recently used leaf
    assert [e.value for e in tree.evict(1)] == [(5,)]
    assert [e.value for e in tree.evict(100)] == [(3, 4), (1, 2)]  # a parent goes once it is a leaf
    assert tree.size == 0 and not tree.root.children


def test_insert_rejects_an_offset_past_the_cached_prefix():
    tree = _tree()
    tree.insert((1, 2), (1, 2))
    with pytest.raises(InvalidParameter):
        tree.insert((1, 2, 3, 4), (4,), offset=3)
    assert tree.insert((1, 2, 3, 4), (2, 3, 4), offset=1) == 2  # the cached part of the value is dropped
    assert tree.match((1, 2, 3, 4)).length == 4


def test_eviction_costs_what_it_frees_not_a_walk_of_the_tree(monkeypatch):
    """2,000 cached prefixes; evicting one token pops one leaf: the tree is never walked (it
    used to visit every node on each call) and the evictable count is not a sum over nodes."""
    tree = _tree()
    for i in range(2000):
        key = (i // 50, 1000 + i)
        tree.insert(key, key)
    tree.lock(tree.match((0, 1000)))
    for _ in range(5000):  # touches push heap entries; the heap stays bounded by the leaves
        tree.match((3, 1150))
    assert len(tree._heap) <= 2 * len(tree._leaves) + 65

    def walked():
        raise AssertionError("eviction walked the tree")

    monkeypatch.setattr(tree, "nodes", walked)
    assert tree.evictable() == tree.size - 2  # all but the locked path (0,) (1000,)
    pops = []
    monkeypatch.setattr(heapq, "heappop", lambda heap, real=heapq.heappop: pops.append(1) or real(heap))
    out = tree.evict(1)
    assert [e.value for e in out] == [(1001,)]  # the least recently used unlocked leaf
    assert len(pops) <= 3, len(pops)
    assert tree.evictable() == tree.size - 2
