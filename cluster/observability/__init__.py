"""What operators see: Prometheus metrics (``metrics``), a request's spans in the
SchedulerActor (``request_trace``) and the API's span (``api_span``). The process-wide tracing
set-up they build on is ``kv_transfer.tracing`` (shared with the workers)."""
