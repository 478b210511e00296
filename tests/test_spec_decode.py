"""Speculative decoding's parts on their own: the n-gram proposer on fixed token lists, and
the rejection sampler's output distribution against the target's (10^5 draws)."""
import pytest
import torch

from lane.spec_decode.ngram_proposer import NgramProposer
from lane.spec_decode.rejection_sampler import rejection_sample


def test_ngram_takes_the_longest_suffix_match_and_its_latest_occurrence():
    p = NgramProposer(3, prompt_lookup_min=1, prompt_lookup_max=3)
    # suffix [7, 8, 9] occurred at 0 (followed by 1 2 3) and at 6 (followed by 4 5 6): the latest wins
    assert p.propose([7, 8, 9, 1, 2, 3, 7, 8, 9, 4, 5, 6, 0, 7, 8, 9]) == [4, 5, 6]
    # the 3-gram [5, 8, 9] never occurred: the 2-gram [8, 9] did, followed by 1
    assert p.propose([8, 9, 1, 3, 5, 8, 9]) == [1, 3, 5]
    # fewer tokens follow the match than k: what there is
    assert p.propose([1, 2, 3, 1, 2]) == [3, 1, 2]


def test_ngram_min_max_no_match_and_length_cap():
    assert NgramProposer(3, 2, 3).propose([5, 1, 9, 1]) == []  # only a 1-gram repeats; min is 2
    assert NgramProposer(3, 1, 3).propose([5, 1, 9, 1]) == [9, 1]
    assert NgramProposer(3, 1, 3).propose([1, 2, 3, 4]) == []  # nothing repeats
    assert NgramProposer(2, 1, 1).propose([4, 6, 4, 6, 4]) == [6, 4]  # max 1: the latest 4 is at 2
    assert NgramProposer(5, 1, 2, max_model_len=7).propose([1, 2, 3, 1, 2]) == [3, 1]  # 7 - 5 = 2 left
    assert NgramProposer(5, 1, 2, max_model_len=5).propose([1, 2, 3, 1, 2]) == []
    with pytest.raises(ValueError):
        NgramProposer(2, 3, 2)


def test_greedy_accepts_while_drafts_match_then_the_target_token_or_a_bonus():
    V = 6
    target = torch.full((3, 4, V), -1.0)
    for b, toks in enumerate([[1, 2, 3, 4], [1, 5, 3, 4], [0, 0, 0, 0]]):
        target[b, torch.arange(4), torch.tensor(toks)] = 1.0
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [2, 2, 2]])
    out = rejection_sample(drafts, target, greedy=True, num_drafts=[3, 3, 0])
    # all three accepted + bonus; one accepted then the target's 5; no drafts: the target's token
    assert out == [[1, 2, 3, 4], [1, 5], [0]]


def _tv(samples: torch.Tensor, p: torch.Tensor) -> float:
    freq = torch.bincount(samples, minlength=p.numel()).double() / samples.numel()
    return 0.5 * float((freq - p.double()).abs().sum())


@pytest.mark.parametrize("one_hot", [False, True])
def test_random_sampling_with_drafts_follows_the_target_distribution(one_hot):
    """For a synthetic target p and drafter q over 8 tokens, the first emitted token of 10^5
    rows is distributed as p (total variation < 0.01), for drafts drawn from q and for
    n-gram drafts (a fixed token, q one-hot); the bonus token after an accepted draft too."""
    torch.manual_seed(0)
    V, N = 8, 100_000
    p = torch.tensor([0.30, 0.05, 0.20, 0.02, 0.13, 0.10, 0.15, 0.05])
    q = torch.tensor([0.05, 0.30, 0.10, 0.20, 0.05, 0.05, 0.05, 0.20])
    p2 = torch.tensor([0.10, 0.10, 0.40, 0.05, 0.05, 0.10, 0.10, 0.10])  # the next position's target
    if one_hot:
        drafts = torch.full((N, 1), 2)
        draft_probs = None
    else:
        drafts = torch.multinomial(q, N, replacement=True)[:, None]
        draft_probs = q.expand(N, 1, V)
    target = torch.stack([p, p2]).expand(N, 2, V)
    out = rejection_sample(drafts, target, draft_probs)
    first = torch.tensor([o[0] for o in out])
    assert _tv(first, p) < 0.01
    bonus = torch.tensor([o[1] for o in out if len(o) == 2])
    assert len(bonus) > 1000 and _tv(bonus, p2) < 0.02


def test_seeded_rows_are_reproducible_and_rows_without_drafts_draw_one_number():
    V = 5
    target = torch.softmax(torch.randn(2, 3, V, generator=torch.Generator().manual_seed(1)), -1)
    drafts = torch.tensor([[1, 2], [0, 0]])

    def run():
        gens = [torch.Generator().manual_seed(7), torch.Generator().manual_seed(8)]
        return rejection_sample(drafts, target, num_drafts=[2, 0], generators=gens), gens

    a, _ = run()
    b, gb = run()
    assert a == b
    # the draft-less row drew exactly one number (its token), as plain sampling does
    probe = torch.Generator().manual_seed(8)
    torch.rand(1, generator=probe)
    assert torch.rand(1, generator=gb[1]) == torch.rand(1, generator=probe)


def test_ngram_equals_a_brute_force_search_on_random_lists():
    """The narrowing search against the definition: every earlier window of n tokens (longest
    n first, ending before the last token), the latest match's continuation."""
    import random

    def brute(tokens, k, lo, hi, max_len):
        L = len(tokens)
        k = min(k, max_len - L) if max_len is not None else k
        for n in range(min(hi, L - 1), lo - 1, -1):
            hits = [h for h in range(L - n) if tokens[h:h + n] == tokens[L - n:]]
            if hits and k > 0:
                return tokens[hits[-1] + n:hits[-1] + n + k]
        return []

    rng = random.Random(0)
    for _ in range(3000):
        t = [rng.randrange(rng.randint(2, 5)) for _ in range(rng.randint(1, 30))]
        k, lo = rng.randint(1, 5), rng.randint(1, 3)
        hi, max_len = rng.randint(lo, 5), rng.choice([None, len(t) + rng.randint(-1, 3)])
        assert NgramProposer(k, lo, hi, max_len).propose(t) == brute(t, k, lo, hi, max_len), (t, k, lo, hi)
