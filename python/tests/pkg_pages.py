"""What the kvtier-package test scripts share: storing a run of pages whose bytes name
their hash, through a ``kvtier.Client`` on the emulated device, and checking every page
was written."""


def store(c, session, base, n):
    """Stores pages ``base .. base+n`` from device slots ``0 .. n`` for ``session``; returns
    their hashes. Fails unless all ``n`` are complete and none failed."""
    hashes = [base + i for i in range(n)]
    for s in range(n):
        c.fill_page(s, base + s)
    r = c.store(hashes, list(range(n)), session=session)
    st = c.wait(r.ticket, 10000)
    assert st.complete == n and st.failed == 0, st
    return hashes
