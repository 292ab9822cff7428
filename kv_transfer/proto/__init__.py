"""Protocol of the gRPC KV transport: ``kv_transfer.proto`` here, and the modules generated from
it at build or install time (``setup.py``): ``kv_transfer_pb2`` (messages) and
``kv_transfer_pb2_grpc`` (service stub and servicer). They are not in the repository."""
