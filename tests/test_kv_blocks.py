"""KV blocks as bytes (executor_service/kv/blocks.py): the CPU's numpy path and torch's give the same bytes,
in and out, whatever the dtype; a block is one run of bytes of the block-major cache, which a layer's view
reads as the model wrote it; and a wrong length is refused."""

import pytest

torch = pytest.importorskip("torch")

from executor_service.kernels.attention import write_slots  # noqa: E402
from executor_service.kv.blocks import BlockBytes  # noqa: E402
from executor_service.kv.tensors import layer_views  # noqa: E402


def cache(dtype, layers=3, num_blocks=12, shape=(4, 2, 8)):
    g = torch.Generator().manual_seed(0)
    return torch.randn(num_blocks, layers, 2, *shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_numpy_path_reads_and_writes_the_same_bytes_as_torch(dtype):
    fast, slow = BlockBytes.of(cache(dtype)), BlockBytes.of(cache(dtype))
    slow = BlockBytes(slow.blocks, slow.size)                 # no rows: torch's index_select and index_copy_
    assert fast.rows is not None
    ids = [7, 2, 9]
    data = slow.read(ids)
    assert fast.read(ids) == data and len(data) == 3 * fast.size
    # Written elsewhere by each path, the same blocks come back, and no other block changed.
    fast.write([1, 5, 11], data)
    slow.write([1, 5, 11], data)
    assert fast.read([1, 5, 11]) == slow.read([1, 5, 11]) == data
    assert fast.read([0, 3, 4]) == slow.read([0, 3, 4])
    assert torch.equal(fast.blocks[5], slow.blocks[5]) and torch.equal(fast.blocks[5], cache(dtype)[2])


def test_a_block_holds_every_layers_keys_then_values_as_the_model_wrote_them():
    blocks = torch.zeros(6, 3, 2, 4, 2, 8)
    caches = layer_views(blocks)
    k = torch.randn(2, 2, 8)
    write_slots(caches[1][1], torch.tensor([4 * 3 + 1, 4 * 5 + 3]), k)      # layer 1's values, blocks 3 and 5
    b = BlockBytes.of(blocks)
    one = torch.frombuffer(bytearray(b.read([3])), dtype=torch.float32).view(3, 2, 4, 2, 8)
    assert torch.equal(one[1, 1, 1], k[0]) and one.count_nonzero() == k[0].numel()
    assert torch.equal(caches[1][1][5, 3], k[1]) and blocks.count_nonzero() == k.numel()


def test_a_write_of_the_wrong_length_is_refused():
    b = BlockBytes.of(cache(torch.float32))
    with pytest.raises(ValueError):
        b.write([1, 2], b"\0" * (b.size + 1))
