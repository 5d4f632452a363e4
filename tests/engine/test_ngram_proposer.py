"""Prompt-lookup proposals: the continuation of the latest earlier occurrence of the longest
matching suffix, the same whether the index was built at once or token by token."""
import random

from shardserve.engine.ngram_proposer import NgramProposer


def brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The rule, by scanning: longest n first, then the latest start that leaves a continuation."""
    num = len(tokens)
    for n in range(min(max_n, num), min_n - 1, -1):
        for start in range(num - n - 1, -1, -1):
            if tokens[start:start + n] == tokens[num - n:]:
                return tokens[start + n:start + n + k]
    return []


def test_longest_suffix_and_latest_occurrence_win():
    p = NgramProposer(1, 3)
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 1, 9, 6, 7, 2, 5, 6, 7]
    # "5 6 7" (n=3) occurred at 0..2, followed by 1 9 6; "6 7" alone occurred later (5..6) but is shorter
    assert p.propose("a", tokens, 3) == [1, 9, 6]
    assert p.propose("b", [1, 2, 3, 4], 3) == []
    assert p.propose("c", [4, 8, 4, 8, 4], 5) == [8, 4]  # "4 8 4" ends at 3: the continuation runs out


def test_incremental_index_matches_a_scan_on_random_streams():
    rng = random.Random(0)
    for trial in range(20):
        p = NgramProposer(2, 4)
        tokens = [rng.randrange(6) for _ in range(3)]
        for _ in range(80):
            assert p.propose("r", tokens, 4) == brute_force(tokens, 4, 2, 4)
            tokens += [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
        p.forget("r")
        assert p.propose("r", tokens, 4) == brute_force(tokens, 4, 2, 4)  # a rebuilt index agrees
