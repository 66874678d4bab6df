"""The shared-memory wire constants the Python side uses, in one place.

They are defined by the C++ headers in proto/include/trainstream/wire/; this copy
lets ``import trainstream`` work without loading the torch extension, and
tests/python/test_wire_constants.py pins every value here to ``trainstream_testing.wire``
(the test-only extension, which reads them from those headers).
"""

# Opcodes (session_control.h, Opcode): daemon -> client.
OP_PARAM_READY = 16
OP_STEP_DONE = 17
OP_STATE_DONE = 18
OP_SYNC_DONE = 19
OP_ERROR = 20
OP_REDUCE_READY = 21
OP_GROUP_BROKEN = 22

# Completion statuses (CompletionStatus).
STATUS_OK = 0
STATUS_SKIPPED_NONFINITE = 1
STATUS_INVALID = 2
STATUS_INTERNAL = 3

# Which optimizer-state tensor a kLoadState/kExportState moves (StateField).
FIELD_MASTER = 0
FIELD_EXP_AVG = 1
FIELD_EXP_AVG_SQ = 2
FIELD_STEP = 3
FIELD_PARAM_FROM_SLOT = 4
FIELD_WEIGHTS = 5

# Element types (dtype.h, DType): state manifests and trainstream.v1.DType carry
# these numbers (Note [DType numbers are the wire's]).
DTYPE_FLOAT32 = 1
DTYPE_BFLOAT16 = 2
DTYPE_FLOAT16 = 3

# Segment header and base manifest (segment_header.h, base_manifest.h).
SEGMENT_MAGIC = 0x54535347
SEGMENT_HEADER_BYTES = 4096
SEGMENT_MANIFEST_OFFSET_FIELD = 120  # offsetof(SegmentHeader, manifest_offset)
BASE_MANIFEST_MAGIC = 0x54534246
BASE_MANIFEST_HEADER_BYTES = 64

# Bytes per trained element the daemon's master takes in a state segment, beyond the
# weight slot, by the weight's dtype (segment_header.h, MasterStateBytes: Note [One host
# copy of a trained weight]): an fp32 weight slot is the master, a bf16 one its high
# half, an fp16 weight keeps a whole fp32 master.
MASTER_STATE_BYTES_FLOAT32 = 0
MASTER_STATE_BYTES_BFLOAT16 = 2
MASTER_STATE_BYTES_FLOAT16 = 4

# The gradient staging pool (grad_pool.h): where its header and first byte lie in a
# pooled staging segment, the header's fields (offsets from the header), the
# alignment of an extent, and GRAD_READY's flag for an extent.
GRAD_POOL_MAGIC = 0x54534750
GRAD_POOL_HEADER_OFFSET = 4096
GRAD_POOL_OFFSET = 8192
GRAD_POOL_ALIGN = 64
GRAD_POOL_CAPACITY_FIELD = 8
GRAD_POOL_RELEASED_FIELD = 64
GRAD_POOL_RELEASE_SEQ_FIELD = 128
GRAD_POOL_WAITERS_FIELD = 132
FLAG_POOLED_GRAD = 1
