"""KV blocks as bytes (executor_service/kv_blocks.py): the CPU's numpy path and torch's give the same bytes,
in and out, whatever the dtype, and a wrong length is refused."""

import pytest

torch = pytest.importorskip("torch")

from executor_service.kv_blocks import BlockBytes  # noqa: E402


def caches(dtype, layers=3, num_blocks=12, shape=(4, 2, 8)):
    g = torch.Generator().manual_seed(0)
    return [tuple(torch.randn(num_blocks, *shape, generator=g).to(dtype) for _ in range(2)) for _ in range(layers)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_numpy_path_reads_and_writes_the_same_bytes_as_torch(dtype):
    fast, slow = BlockBytes.of(caches(dtype)), BlockBytes.of(caches(dtype))
    slow = BlockBytes(slow.caches, slow.size)                 # no rows: torch's index_select and index_copy_
    assert fast.rows is not None
    ids = [7, 2, 9]
    data = slow.read(ids)
    assert fast.read(ids) == data and len(data) == 3 * fast.size
    into = bytearray(len(data))
    fast.read_into(ids, memoryview(into))
    assert bytes(into) == data
    # Written elsewhere by each path, the same blocks come back, and no other block changed.
    fast.write([1, 5, 11], data)
    slow.write([1, 5, 11], data)
    assert fast.read([1, 5, 11]) == slow.read([1, 5, 11]) == data
    assert fast.read([0, 3, 4]) == slow.read([0, 3, 4])
    k_fast, k_slow = fast.caches[0][0], slow.caches[0][0]
    assert torch.equal(k_fast[5], k_slow[5]) and torch.equal(k_fast[5], BlockBytes.of(caches(dtype)).caches[0][0][2])


def test_a_write_of_the_wrong_length_is_refused():
    b = BlockBytes.of(caches(torch.float32))
    with pytest.raises(ValueError):
        b.write([1, 2], b"\0" * (b.size + 1))
