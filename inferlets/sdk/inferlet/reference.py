"""Plain-Python references of the epilogue IR's speculative ops, on lists.

Pure Python (runs inside the Wasm component): the Cacheback program fills its channels' first
contents with them, and the tests check the host's ops against them.
"""


def ngram_lookup(seq, k, ngram_min=1, ngram_max=3):
    """Same rule as the IR's ngram_lookup: tokens that followed the most recent earlier
    occurrence of the longest matching suffix (ngram_max down to ngram_min)."""
    n = len(seq)
    for g in range(min(ngram_max, n - 1), ngram_min - 1, -1):
        suffix = seq[n - g:]
        for i in range(n - g - 1, -1, -1):
            if seq[i:i + g] == suffix:
                return list(seq[i + g:min(i + g + k, n)])
    return []


def lru_lookup(table, stamps, key, g, k):
    """The IR's lru_lookup on flat lists: the followers of the live entry whose leader is key."""
    best = -1
    if min(key, default=0) >= 0:
        for s, st in enumerate(stamps):
            if st >= 0 and table[s * (g + k):s * (g + k) + g] == list(key) and (best < 0 or st > stamps[best]):
                best = s
    if best < 0:
        return []
    out = []
    for x in table[best * (g + k) + g:(best + 1) * (g + k)]:
        if x < 0:
            break
        out.append(x)
    return out


def lru_update(table, stamps, seq, length, leaders, g, k):
    """The IR's lru_update on flat lists; returns new (table, stamps)."""
    table, stamps = list(table), list(stamps)
    S, w = len(stamps), g + k
    length = max(0, min(length, len(seq)))
    last = {}  # leader -> (position, followers): the last occurrence counts
    for i in range(max(0, min(leaders, len(seq) - g))):
        lead = tuple(seq[i:i + g])
        fol = []
        for x in seq[i + g:min(i + g + k, length)]:
            if x < 0:
                break
            fol.append(x)
        if fol and min(lead) >= 0:
            last.pop(lead, None)
            last[lead] = fol  # re-inserted: dict order is the order of last occurrence
    slot_of = {tuple(table[s * w:s * w + g]): s for s in range(S) if stamps[s] >= 0}
    refreshed = {slot_of[lead] for lead in last if lead in slot_of}
    free = sorted((s for s in range(S) if s not in refreshed), key=lambda s: (stamps[s], s))
    new = [lead for lead in last if lead not in slot_of]
    dropped = set(new[:max(0, len(new) - len(free))])
    top, r, written = max(stamps, default=-1), 0, 0
    for lead, fol in last.items():
        if lead in dropped:
            continue
        if lead in slot_of:
            s = slot_of[lead]
        else:
            s, r = free[r], r + 1
        written += 1
        table[s * w:(s + 1) * w] = list(lead) + fol + [-1] * (k - len(fol))
        stamps[s] = top + written
    return table, stamps
