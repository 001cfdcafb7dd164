"""gRPC metadata keys the services set for each other, beside the messages the .proto files define."""

# The Step stream's epoch, sent once when the scheduler opens the stream: an executor stops KV pulls of an older
# stream before any step of this one runs.
STEP_EPOCH = "stepwire-epoch"
# A PullBlocks' trailer from the executor that ran it: the pull is over and none of its writes remains, so the
# blocks it was given may be reused at once.
PULL_ENDED = "stepwire-pull-ended"
