"""`python -m baton.prefill_service`."""
from baton.serving.logs import quiet_grpc

quiet_grpc()                    # before grpc is imported: it reads GRPC_VERBOSITY then
from baton.prefill_service.main import main  # noqa: E402

main()
