"""Token trees: one target pass over a tree (mask, positions, cache compaction) against each branch run as a
chain; tree acceptance (greedy, and sampling checked statistically with negative controls); the `draft-tree`
method end to end."""

from __future__ import annotations


import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specdraft import Engine, SamplingParams, SpecConfig, SpecdraftError, load_model
from specdraft.acceptance import (accept_tree_greedy, accept_tree_rejection, reference_accept_tree_greedy,
                                  reference_accept_tree_rejection)
from specdraft.drafters import TreeDrafter, build_drafter
from specdraft.drafters.tree import grow_dynamic_tree
from specdraft.sampling import sample
from specdraft.types import Acceptance, Draft
from tiny import build_model

PREFIX = [2, 3, 4, 5, 6]
# A tree of 8 nodes under the pending token: two roots, branches of depth up to 4, siblings at several levels.
TREE_IDS = [7, 8, 9, 10, 11, 3, 4, 12]
TREE_PARENTS = [-1, -1, 0, 0, 2, 1, 4, 5]
GREEDY = SamplingParams(max_new_tokens=24)
PROMPTS = ["abc ab", "j. ihg", "a", "dead beef cafe. dead be"]


def branch_of(node: int, ids: list[int], parents: list[int]) -> list[int]:
    """The tokens from the root down to `node`."""
    tokens = []
    while node >= 0:
        tokens.append(ids[node])
        node = parents[node]
    return tokens[::-1]


@pytest.fixture(scope="module")
def near_draft_dir(tiny_dirs, tmp_path_factory):
    """The target with its weights perturbed: a draft that agrees often but not always (partial acceptance on
    tree paths that are not the first branch)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tmp_path_factory.mktemp("near") / "near"
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["target"], dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.15 * parameter.std() * torch.randn(parameter.shape, generator=generator))
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_dirs["target"]).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def native_bf16(tiny_dirs, near_draft_dir):
    return {"target": load_model(str(tiny_dirs["target"]), "bfloat16", backend="native"),
            "near": load_model(str(near_draft_dir), "bfloat16", backend="native")}


# ------------------------------------------------------------------------------------------------ one tree pass

def assert_rows_equal(got: torch.Tensor, expected: torch.Tensor, backend: str) -> None:
    if backend == "native":  # batch-invariant kernels: bit for bit
        assert torch.equal(got, expected), f"max difference {(got - expected).abs().max():.3g}"
    else:  # the generic forward rounds differently with the number of rows
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_a_tree_pass_gives_each_node_the_logits_of_its_branch_run_as_a_chain(tiny_models):
    model = tiny_models["target"]
    with torch.inference_mode():
        state = model.new_state()
        state.forward(PREFIX, 1)
        tree_logits = state.forward_tree(TREE_IDS, TREE_PARENTS, len(TREE_IDS))  # [8, V]
        for node in range(len(TREE_IDS)):
            chain = model.new_state().forward(PREFIX + branch_of(node, TREE_IDS, TREE_PARENTS), 1)[0]
            assert_rows_equal(tree_logits[node], chain, model.backend)
    assert state.tree_start == len(PREFIX) and state.tree_depths == [0, 0, 1, 1, 2, 1, 3, 2]


def test_a_tree_pass_equals_branches_bit_for_bit_in_bf16(native_bf16):
    model = native_bf16["target"]
    with torch.inference_mode():
        state = model.new_state()
        state.forward(PREFIX, 1)
        tree_logits = state.forward_tree(TREE_IDS, TREE_PARENTS, len(TREE_IDS))
        for node in range(len(TREE_IDS)):
            chain = model.new_state().forward(PREFIX + branch_of(node, TREE_IDS, TREE_PARENTS), 1)[0]
            assert torch.equal(tree_logits[node], chain)


def test_a_tree_grown_over_several_passes_matches_its_branches(tiny_models):
    """The drafter's use: each pass expands a frontier whose parents were cached by earlier passes."""
    model = tiny_models["target"]
    with torch.inference_mode():
        state = model.new_state()
        state.forward(PREFIX, 1)
        first = state.forward_tree(TREE_IDS[:2], TREE_PARENTS[:2], 2)
        second = state.forward_tree(TREE_IDS[2:5], TREE_PARENTS[2:5], 3)
        third = state.forward_tree(TREE_IDS[5:], TREE_PARENTS[5:], 3)
        for node, row in enumerate(torch.cat([first, second, third])):
            chain = model.new_state().forward(PREFIX + branch_of(node, TREE_IDS, TREE_PARENTS), 1)[0]
            assert_rows_equal(row, chain, model.backend)


@pytest.mark.parametrize("path", [[1, 5, 7], [0, 2, 4, 6], [0, 3], [1], []])
def test_keeping_a_path_compacts_the_cache_to_that_branch(tiny_models, path):
    """After compaction the cache is the branch's own: the next token's logits equal a fresh chain's."""
    model = tiny_models["target"]
    branch = [TREE_IDS[n] for n in path]
    with torch.inference_mode():
        state = model.new_state()
        state.forward(PREFIX, 1)
        state.forward_tree(TREE_IDS, TREE_PARENTS, len(TREE_IDS))
        state.keep_tree_path(path)
        assert state.token_ids == PREFIX + branch and state.cache_length == len(PREFIX) + len(path)
        assert state.tree_parents == [] and state.tree_start == len(state)
        after = state.forward([9, 10], 2)
        chain = model.new_state().forward(PREFIX + branch + [9, 10], 2)
    assert_rows_equal(after, chain, model.backend)


def test_verify_and_keep_verified_handle_chains_and_trees(tiny_models):
    model = tiny_models["target"]
    pending = PREFIX[-1]
    tree = Draft(torch.tensor(TREE_IDS), parents=torch.tensor(TREE_PARENTS))
    chain = Draft(torch.tensor([7, 9, 11]))
    with torch.inference_mode():
        for draft, accepted in ((tree, [1, 5]), (chain, [0, 1]), (Draft(torch.empty(0, dtype=torch.long)), [])):
            state = model.new_state()
            state.forward(PREFIX[:-1], 1)
            logits = state.verify(pending, draft)
            assert logits.shape[0] == draft.k + 1
            state.keep_verified(accepted)
            kept = [int(draft.token_ids[n]) for n in accepted]
            assert state.token_ids == PREFIX + kept and state.cache_length == len(PREFIX) + len(kept)
            assert_rows_equal(state.forward([3], 1), model.new_state().forward(PREFIX + kept + [3], 1), model.backend)


def test_sync_drops_a_cached_tree(tiny_models):
    with torch.inference_mode():
        state = tiny_models["target"].new_state()
        state.forward(PREFIX, 1)
        state.forward_tree(TREE_IDS, TREE_PARENTS, 1)
        # the tree's first root equals the context's next token, but tree nodes are candidates, not a sequence
        assert state.sync(PREFIX + [TREE_IDS[0], 9]) == [TREE_IDS[0], 9]
        assert state.token_ids == PREFIX and state.cache_length == len(PREFIX) and state.tree_parents == []


def test_bad_trees_are_refused(tiny_models):
    with torch.inference_mode():
        state = tiny_models["target"].new_state()
        state.forward(PREFIX, 1)
        with pytest.raises(ValueError, match="parent"):
            state.forward_tree([7, 8], [-1, 1], 2)  # a node cannot be its own parent
        state.forward_tree([7, 8, 9], [-1, 0, -1], 3)
        with pytest.raises(ValueError, match="path"):
            state.keep_tree_path([0, 2])  # 2 is a root, not a child of 0
        with pytest.raises(ValueError, match="tree is still cached"):
            state.verify(5, Draft(torch.tensor([1])))
    with pytest.raises(ValueError, match="parents"):
        Draft(torch.tensor([1, 2]), parents=torch.tensor([0, -1]))  # parents must come before children
    with pytest.raises(ValueError, match="shape"):
        Draft(torch.tensor([1, 2]), parents=torch.tensor([-1]))


def test_a_model_whose_attention_takes_no_mask_is_refused_clearly(tiny_dirs):
    model = load_model(str(tiny_dirs["target"]), "float32", backend="transformers")
    with torch.inference_mode():
        state = model.new_state()
        state.forward(PREFIX, 1)
        # as if loaded with flash attention (not installed here): the tree pass must refuse before running
        model.model.config._attn_implementation_internal = "flash_attention_2"
        with pytest.raises(SpecdraftError, match="custom attention mask"):
            state.forward_tree([7, 8], [-1, -1], 2)


# ------------------------------------------------------------------------------------------------ greedy rule

def test_greedy_tree_keeps_the_longest_matching_path_then_the_target_token():
    ids = torch.tensor([5, 6, 7, 8, 9])
    parents = torch.tensor([-1, -1, 0, 1, 3])
    # target argmax rows: after pending 6; after node 0 (5) 7; after node 1 (6) 8; after node 3 (8) 9; after 4: 2
    argmax = torch.tensor([6, 7, 8, 1, 9, 2])
    result = accept_tree_greedy(ids, parents, argmax)
    assert (result.n_accepted, result.tokens, result.nodes) == (3, [6, 8, 9, 2], [1, 3, 4])


def test_greedy_tree_with_no_matching_root_emits_the_target_token():
    result = accept_tree_greedy(torch.tensor([5, 6]), torch.tensor([-1, -1]), torch.tensor([4, 0, 0]))
    assert (result.n_accepted, result.tokens, result.accepted_nodes) == (0, [4], [])


def test_greedy_tree_reference_twin_agrees_on_random_trees():
    rng = np.random.default_rng(3)
    for _ in range(300):
        k = int(rng.integers(1, 9))
        parents = [int(rng.integers(-1, i)) for i in range(k)]
        ids = rng.integers(0, 3, size=k).tolist()
        argmax = rng.integers(0, 3, size=k + 1).tolist()
        fast = accept_tree_greedy(torch.tensor(ids), torch.tensor(parents), torch.tensor(argmax))
        assert fast == reference_accept_tree_greedy(ids, parents, argmax)


def test_a_chain_written_as_a_tree_accepts_like_the_chain_rule():
    from specdraft.acceptance import accept_greedy

    rng = np.random.default_rng(4)
    for _ in range(100):
        ids = rng.integers(0, 3, size=4).tolist()
        argmax = torch.tensor(rng.integers(0, 3, size=5).tolist())
        chain = accept_greedy(torch.tensor(ids), argmax)
        tree = accept_tree_greedy(torch.tensor(ids), torch.tensor([-1, 0, 1, 2]), argmax)
        assert (chain.n_accepted, chain.tokens, chain.accepted_nodes) == (tree.n_accepted, tree.tokens, tree.nodes)


# ------------------------------------------------------------------------------------------------ sampling rule
#
# A two-level "target" over V = 4 tokens: p(t1) and p(t2 | t1); a "draft" q(t1), q(t2 | t1) far from it. Each
# trial builds a tree (2 children per node, depth 2) by one sibling scheme, runs a rule, and records the first
# two emitted tokens; when a pass emits only one (the root's children were all rejected), the second is drawn
# from p(t2 | t1), as the next target pass would. Exact rules give the joint p(t1) p(t2 | t1).
#
# Sample size N = 6000 per test; an exact rule passes when the chi-square p-value over the 16 cells is > 1e-3
# (fails by chance with probability 1e-3). The negative controls must give p < 1e-3: their bias (e.g. 0.09 too
# much mass on the first sibling's token when the residual is not updated) is large against the resolution at N.

V = 4
TARGET_FIRST = torch.tensor([0.1, 0.2, 0.3, 0.4])
TARGET_SECOND = torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1],
                              [0.1, 0.2, 0.3, 0.4], [0.05, 0.05, 0.1, 0.8]])
DRAFT_FIRST = torch.tensor([0.5, 0.3, 0.15, 0.05])
DRAFT_SECOND = torch.tensor([[0.4, 0.4, 0.1, 0.1], [0.1, 0.6, 0.2, 0.1],
                             [0.6, 0.2, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]])
N_STAT, P_STAT = 6000, 1e-3


def _children(q_row: torch.Tensor, scheme: str, generator) -> tuple[list[int], list[torch.Tensor] | None]:
    """Two children of one node and the rows they were drawn from (None: deterministic)."""
    if scheme == "deterministic":
        return torch.topk(q_row, 2).indices.tolist(), None
    first = int(sample(q_row.unsqueeze(0), generator))
    if scheme == "iid":
        return [first, int(sample(q_row.unsqueeze(0), generator))], [q_row, q_row]
    without = q_row.clone()
    without[first] = 0
    without = without / without.sum()
    rows = [q_row, without if scheme == "without-replacement" else q_row]  # "wrong-rows": i.i.d. rows
    return [first, int(sample(without.unsqueeze(0), generator))], rows


def random_tree(scheme: str, generator):
    """(ids [6], parents [6], draft_probs [6, V] | None, target_probs [7, V]) for one trial."""
    ids, parents, rows = [], [], []
    targets = [TARGET_FIRST]
    root_ids, root_rows = _children(DRAFT_FIRST, scheme, generator)
    for token, row in zip(root_ids, root_rows or [None, None]):
        ids.append(token), parents.append(-1), rows.append(row), targets.append(TARGET_SECOND[token])
    for parent in (0, 1):
        child_ids, child_rows = _children(DRAFT_SECOND[ids[parent]], scheme, generator)
        for token, row in zip(child_ids, child_rows or [None, None]):
            ids.append(token), parents.append(parent), rows.append(row), targets.append(torch.full((V,), 0.25))
    draft_probs = None if rows[0] is None else torch.stack(rows)
    return torch.tensor(ids), torch.tensor(parents), draft_probs, torch.stack(targets)


def no_residual_update(draft_ids, parents, draft_probs, target_probs, generator) -> Acceptance:
    """Deliberately wrong (negative control): every sibling is tested against the node's original p, and the
    recovered token comes from norm((p - q_last)+) of the last sibling only."""
    ids, parent_list = draft_ids.tolist(), parents.tolist()
    nodes, row = [], 0
    while True:
        p_row = target_probs[row]
        kids = [c for c, parent in enumerate(parent_list) if parent + 1 == row]
        kept, residual = None, p_row
        for child in kids:
            token = ids[child]
            q_row = draft_probs[child] if draft_probs is not None else torch.nn.functional.one_hot(
                torch.tensor(token), p_row.shape[0]).float()
            if float(torch.rand(1, generator=generator)) * float(q_row[token]) < float(p_row[token]):
                kept = child
                break
            residual = (p_row - q_row).clamp_min(0)
        if kept is None:
            final = int(sample((residual / residual.sum()).unsqueeze(0), generator))
            return Acceptance(len(nodes), [ids[n] for n in nodes] + [final], nodes)
        nodes.append(kept)
        row = kept + 1


def fast_rule(draft_ids, parents, draft_probs, target_probs, generator) -> Acceptance:
    return accept_tree_rejection(draft_ids, parents, draft_probs, target_probs, generator)


def reference_rule(draft_ids, parents, draft_probs, target_probs, generator) -> Acceptance:
    return reference_accept_tree_rejection(draft_ids.tolist(), parents.tolist(),
                                           None if draft_probs is None else draft_probs.tolist(),
                                           target_probs.tolist(), generator)


def joint_pvalue(rule, scheme: str, n: int = N_STAT, seed: int = 0) -> tuple[float, float]:
    """(chi-square p-value, total variation) of the first two emitted tokens against p(t1) p(t2 | t1)."""
    generator = torch.Generator().manual_seed(seed)
    counts = np.zeros((V, V))
    for _ in range(n):
        tokens = rule(*random_tree(scheme, generator), generator).tokens
        if len(tokens) < 2:
            tokens = tokens + [int(sample(TARGET_SECOND[tokens[0]].unsqueeze(0), generator))]
        counts[tokens[0], tokens[1]] += 1
    expected = (TARGET_FIRST[:, None] * TARGET_SECOND).double().numpy()
    expected *= n / expected.sum()  # float32 rows sum to 1 only roughly; chisquare wants equal totals
    tv = 0.5 * np.abs(counts - expected).sum() / n
    return float(chisquare(counts.ravel(), expected.ravel()).pvalue), float(tv)


@pytest.mark.parametrize("scheme", ["iid", "without-replacement", "deterministic"])
@pytest.mark.parametrize("rule", [fast_rule, reference_rule], ids=["fast", "reference"])
def test_tree_sampling_emits_the_target_distribution(rule, scheme):
    pvalue, tv = joint_pvalue(rule, scheme)
    assert pvalue > P_STAT, f"p-value {pvalue:.2e}, total variation {tv:.3f} at N={N_STAT}"


@pytest.mark.parametrize("scheme", ["iid", "deterministic"])
def test_negative_control_no_residual_update_between_siblings_fails(scheme):
    pvalue, tv = joint_pvalue(no_residual_update, scheme)
    assert pvalue < P_STAT, f"the wrong rule passed: p-value {pvalue:.2e}, total variation {tv:.3f} at N={N_STAT}"


def test_negative_control_iid_rows_for_children_drawn_without_replacement_fails():
    """The rule is lossless only with the rows the children were really drawn from."""
    pvalue, tv = joint_pvalue(fast_rule, "wrong-rows")
    assert pvalue < P_STAT, f"the wrong pairing passed: p-value {pvalue:.2e}, total variation {tv:.3f}"


def test_tree_rule_rejects_a_child_the_target_never_emits_and_tries_its_sibling():
    ids, parents = torch.tensor([0, 1]), torch.tensor([-1, -1])
    target_probs = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.25] * 4, [0.0, 0.0, 0.0, 1.0]])
    for seed in range(20):
        result = accept_tree_rejection(ids, parents, None, target_probs, torch.Generator().manual_seed(seed))
        assert (result.n_accepted, result.tokens, result.nodes) == (1, [1, 3], [1])


# ------------------------------------------------------------------------------------------------ dynamic trees

def test_dynamic_tree_keeps_the_best_scored_nodes_as_a_tree():
    scores = torch.log(torch.tensor([[0.6, 0.3, 0.1], [0.9, 0.05, 0.05], [0.5, 0.4, 0.1]]))
    calls = []

    def expand(tokens, parents):  # next-token scores depend on the last token only
        calls.append((tokens, parents))
        return scores[torch.tensor(tokens)]

    tokens, parents = grow_dynamic_tree(scores[0], expand, depth=3, branch=2, budget=4)
    # level 1: 0 (.6), 1 (.3); expanding both: 0-0 (.36), 0-1 (.18), 1-0 (.27), 1-x (.015). The 4th best so far
    # is .27, so level 3 expands only 0-0 (a child of 1-0 could not beat it): 0-0-0 (.216), 0-0-1 (.108).
    # The best 4: 0, 0-0, 1, 1-0, listed parents first.
    assert tokens == [0, 1, 0, 0] and parents == [-1, -1, 0, 1]
    assert calls == [([0, 1], [-1, -1]), ([0], [0])]  # frontier parents index the expanded nodes


def test_a_confidence_floor_leaves_unsure_nodes_without_children():
    """The scores of the test above with min_confidence 0.7: token 0's next-token top-1 is 0.6, so no node ending
    in 0 gets children, and token 1's (0.9) does; without the floor 0-0 was kept (the test above)."""
    scores = torch.log(torch.tensor([[0.6, 0.3, 0.1], [0.9, 0.05, 0.05], [0.5, 0.4, 0.1]]))
    calls = []

    def expand(tokens, parents):
        calls.append((tokens, parents))
        return scores[torch.tensor(tokens)]

    tokens, parents = grow_dynamic_tree(scores[0], expand, depth=3, branch=2, budget=4, min_confidence=0.7)
    # level 1: 0 (.6), 1 (.3); expanding both: 0 is unsure, 1 gives 1-0 (.27), 1-1 (.015); level 3 expands 1-0
    # (unsure: nothing). Kept: 0, 1, 1-0, 1-1.
    assert tokens == [0, 1, 0, 1] and parents == [-1, -1, 1, 1]
    assert calls == [([0, 1], [-1, -1]), ([0], [1])]


def test_a_draft_tree_with_a_confidence_floor_stays_greedy_exact_and_drafts_fewer_nodes(tiny_models):
    target = tiny_models["target"]
    drafted = {}
    for min_confidence in (0.0, 0.9):
        drafter = TreeDrafter(target, target, 6, 4, 2, min_confidence=min_confidence)
        engine = Engine(target, drafter, SpecConfig("draft-tree", tree_budget=6))
        drafted[min_confidence] = 0
        for prompt in PROMPTS:
            ids = engine.encode(prompt, chat=False)
            got = engine.generate(ids, GREEDY)
            assert got.token_ids == Engine(target).generate(ids, GREEDY).token_ids, prompt
            drafted[min_confidence] += got.stats.drafted / got.stats.target_passes
    assert drafted[0.9] < drafted[0.0]  # unsure nodes got no children


def test_statistics_count_tree_passes_by_depth():
    from specdraft.types import SpecStats

    stats = SpecStats(method="draft-tree", gamma=3)
    tree = Draft(torch.tensor(TREE_IDS), parents=torch.tensor(TREE_PARENTS))
    assert tree.depth == 4 and Draft(torch.tensor([1, 2])).depth == 2
    stats.record(tree.k, 2, tree.depth)
    stats.record(3, 3)  # a chain
    assert (stats.tree_passes, stats.mean_tree_size, stats.mean_tree_path) == (1, 8.0, 2.0)
    assert stats.drafted == 11 and stats.accepted == 5 and stats.examined == 3 + 3
    assert stats.drafted_per_position == [2, 2, 2, 1] and stats.accepted_per_position == [2, 2, 1, 0]


def test_tree_knobs_are_validated():
    with pytest.raises(SpecdraftError, match="tree budget"):
        SpecConfig("draft-tree", tree_budget=0)
    with pytest.raises(SpecdraftError, match="tree depth"):
        SpecConfig("draft-tree", tree_depth=0)
    with pytest.raises(SpecdraftError, match="tree branch"):
        SpecConfig("draft-tree", tree_branch=0)
    assert SpecConfig("draft-tree", tree_depth=6).draft_len == 6


def test_draft_tree_without_a_draft_model_is_a_user_error(tiny_models):
    with pytest.raises(SpecdraftError, match="draft-tree"):
        build_drafter(SpecConfig("draft-tree"), tiny_models["target"], None)


# ------------------------------------------------------------------------------------------------ the method

def tree_engine(target, draft, budget: int = 6, depth: int = 4, branch: int = 2) -> Engine:
    spec = SpecConfig("draft-tree", tree_budget=budget, tree_depth=depth, tree_branch=branch)
    return Engine(target, TreeDrafter(draft, target, budget, depth, branch), spec)


@pytest.mark.parametrize("draft_name", ["draft", "near", "target"])
def test_draft_tree_greedy_equals_autoregressive(tiny_models, tiny_dirs, near_draft_dir, draft_name):
    target = tiny_models["target"]
    draft = (load_model(str(near_draft_dir), "float32", backend=target.backend) if draft_name == "near"
             else tiny_models[draft_name])
    engine = tree_engine(target, draft)
    for prompt in PROMPTS:
        ids = engine.encode(prompt, chat=False)
        expected = Engine(target).generate(ids, GREEDY).token_ids
        got = engine.generate(ids, GREEDY)
        assert got.token_ids == expected, prompt
    assert got.stats.tree_passes > 0 and got.stats.mean_tree_size <= 6
    if draft_name == "target":  # the draft's top-1 branch is the target's choice: always accepted
        assert got.stats.tau > 2.5


@pytest.mark.parametrize("context_tokens", [1, 3])
def test_a_draft_tree_reading_the_prompts_end_only_stays_greedy_exact(tiny_models, context_tokens):
    """draft_context on a tree: the draft model reads the prompt's last tokens, and starts over on the context's
    last ones whenever more went by unseen; the output is plain decoding's and the draft's cache starts at the
    window or later. The builder passes the setting on."""
    target, draft = tiny_models["target"], tiny_models["target"]  # the target as its draft: paths get accepted
    drafter = TreeDrafter(draft, target, 6, 4, 2, context_tokens)
    engine = Engine(target, drafter, SpecConfig("draft-tree", tree_budget=6, draft_context=context_tokens))
    for prompt in PROMPTS:
        ids = engine.encode(prompt, chat=False)
        got = engine.generate(ids, GREEDY)
        assert got.token_ids == Engine(target).generate(ids, GREEDY).token_ids, prompt
        assert max(0, len(ids) - context_tokens) <= drafter.context_start < len(ids) + len(got.token_ids)
    assert got.stats.tree_passes > 0 and got.stats.accepted > 0
    built = build_drafter(SpecConfig("draft", tree=True, draft_context=context_tokens), target, draft)
    assert built.inner.context_tokens == context_tokens  # (behind lookup first)


def test_a_one_branch_tree_is_a_chain_and_accepts_fully_with_the_target_as_draft(tiny_models):
    target = tiny_models["target"]
    engine = tree_engine(target, target, budget=4, depth=4, branch=1)
    ids = engine.encode("abc ab", chat=False)
    got = engine.generate(ids, GREEDY)
    assert got.token_ids == Engine(target).generate(ids, GREEDY).token_ids
    assert got.stats.tau > 4.0 and got.stats.accepted == got.stats.drafted


def test_draft_tree_greedy_equals_autoregressive_in_native_bf16(native_bf16):
    target, draft = native_bf16["target"], native_bf16["near"]
    engine = tree_engine(target, draft, budget=8, depth=5, branch=3)
    accepted = 0
    for prompt in PROMPTS:
        ids = engine.encode(prompt, chat=False)
        got = engine.generate(ids, GREEDY)
        assert got.token_ids == Engine(target).generate(ids, GREEDY).token_ids, prompt
        accepted += got.stats.accepted
    assert accepted > 0


def test_draft_tree_accepts_paths_beyond_the_first_branch(tiny_models, near_draft_dir):
    """The point of a tree: some accepted paths leave the draft's top-1 chain."""
    target = tiny_models["target"]
    draft = load_model(str(near_draft_dir), "float32", backend=target.backend)
    engine = tree_engine(target, draft, budget=8, depth=4, branch=3)
    off_chain = sum(_count_off_chain(engine, target, engine.encode(prompt, chat=False)) for prompt in PROMPTS)
    assert off_chain > 0


def _count_off_chain(engine: Engine, target, ids: list[int]) -> int:
    """Passes whose accepted path contains a node that is not its parent's first child (replayed by hand)."""
    from specdraft.acceptance import accept_draft

    drafter, state = engine.drafter, target.new_state()
    if len(ids) > 1:
        state.forward(ids[:-1], 1)
    drafter.begin(ids)
    context, count = list(ids), 0
    with torch.inference_mode():
        while len(context) < len(ids) + 16:
            draft = drafter.propose(context, 4, GREEDY, None)
            result = accept_draft(draft, state.verify(context[-1], draft), GREEDY, None)
            parents = draft.parent_list
            firsts = {parents.index(p) for p in set(parents)}
            count += any(node not in firsts for node in result.accepted_nodes)
            state.keep_verified(result.accepted_nodes)
            context.extend(result.tokens)
            drafter.on_accept(context)
    return count


# Engine-level exactness of draft-tree sampling: the first two emitted tokens of the whole loop against the
# target's exact joint (as in test_exactness.py; N = 1000 per backend, pass if p > 1e-3; the negative control
# must give p < 1e-3).
N_ENGINE = 1000


def engine_tree_pvalue(target, draft, params: SamplingParams, rule=None) -> float:
    from test_exactness import engine_chi_square_pvalue

    engine = tree_engine(target, draft, budget=6, depth=3, branch=3)
    if rule is not None:
        engine.tree_sampling_rule = rule
    return engine_chi_square_pvalue(engine, target, params, N_ENGINE)


@pytest.fixture(scope="module", params=["native", "transformers"])
def small_vocab_pair(tmp_path_factory, request):
    root = tmp_path_factory.mktemp("tree_small_vocab")
    target = load_model(str(build_model(root / "t", seed=11, chars="abcde", init_range=0.5)), "float32",
                        backend=request.param)
    draft = load_model(str(build_model(root / "d", seed=12, chars="abcde", init_range=0.5, layers=1)), "float32",
                       backend=request.param)
    return target, draft


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, max_new_tokens=3),
                                    SamplingParams(temperature=0.7, top_k=3, max_new_tokens=3)],
                         ids=["T=1", "T=0.7,top-k=3"])
def test_draft_tree_sampling_emits_the_target_distribution(small_vocab_pair, params):
    target, draft = small_vocab_pair
    pvalue = engine_tree_pvalue(target, draft, params)
    assert pvalue > P_STAT, f"p-value {pvalue:.2e} at N={N_ENGINE}"


def test_draft_tree_negative_control_fails_the_same_test(small_vocab_pair):
    target, draft = small_vocab_pair
    pvalue = engine_tree_pvalue(target, draft, SamplingParams(temperature=1.0, max_new_tokens=3),
                                rule=no_residual_update)
    assert pvalue < P_STAT, f"the wrong rule passed: p-value {pvalue:.2e} at N={N_ENGINE}"


def test_bench_runs_draft_tree_with_its_knobs_and_records_tree_statistics(tiny_models, tiny_dirs, tmp_path):
    import json

    from specdraft.bench.methods import BenchModels
    from specdraft.bench.options import BenchSettings
    from specdraft.bench.runner import run_bench

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"question_id": "code-1", "category": "code", "turns": ["abc abc abc ab"]}) + "\n")
    settings = BenchSettings(prompts=str(prompts), methods=("ar", "draft-tree"), target=str(tiny_dirs["target"]),
                             draft=str(tiny_dirs["target"]), gammas=(2, 4), max_new_tokens=12, dtype="float32",
                             out=str(tmp_path / "out"), chat=False, warmup_tokens=2,
                             options=(("tree_branch", 2), ("tree_budget", 7), ("tree_depth", 3)))
    models = BenchModels(settings.model_config(), tiny_models["target"], tiny_models["target"])
    run_bench(settings, progress=False, models=models)
    records = [json.loads(line) for line in (tmp_path / "out" / "records.jsonl").read_text().splitlines()]
    tree = [r for r in records if r["method"] == "draft-tree"]
    assert [r["label"] for r in tree] == ["draft-tree"]  # no gamma sweep: the depth comes from the tree knobs
    stats = tree[0]["stats"]
    assert stats["gamma"] == 3 and stats["tree_passes"] > 0 and 0 < stats["mean_tree_size"] <= 7
    assert tree[0]["output_ids"] == next(r for r in records if r["method"] == "ar")["output_ids"]


# ------------------------------------------------------------------------------------------------ prompt lookup

def test_trie_merges_continuations_in_priority_order_within_the_budget():
    from specdraft.drafters.tree import build_trie

    tokens, parents = build_trie([[5, 6, 7], [5, 8], [9, 6]], budget=5)
    assert tokens == [5, 6, 7, 8, 9] and parents == [-1, 0, 1, 0, -1]
    assert build_trie([[5, 6, 7], [5, 8], [9, 6]], budget=4) == ([5, 6, 7, 8], [-1, 0, 1, 0])
    assert build_trie([], budget=4) == ([], [])


def test_prompt_lookup_finds_every_earlier_continuation_longest_ngram_first():
    from specdraft.drafters.tree import find_continuations

    context = [1, 2, 3, 9, 1, 2, 4, 5, 2]
    # suffix [2]: followed by 4 (latest) and 3; no longer suffix matches ([5, 2] occurs once)
    assert find_continuations(context, 2, 3, 1) == [[4, 5], [3, 9]]
    assert find_continuations([1, 2, 1, 2], 3, 2, 1) == [[1, 2]]  # the 1-gram's continuation is the same: kept once


@pytest.mark.parametrize("prompt", ["abc abc abd abe ab", "dead beef cafe. dead be", "a"])
def test_prompt_lookup_tree_greedy_equals_autoregressive(tiny_models, prompt):
    from specdraft.drafters import PromptLookupTreeDrafter

    target = tiny_models["target"]
    engine = Engine(target, PromptLookupTreeDrafter(6, 4), SpecConfig("prompt-lookup-tree", tree_budget=6))
    ids = engine.encode(prompt, chat=False)
    got = engine.generate(ids, GREEDY)
    assert got.token_ids == Engine(target).generate(ids, GREEDY).token_ids
    if prompt.startswith("abc"):
        assert got.stats.tree_passes > 0
