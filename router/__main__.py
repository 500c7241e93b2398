"""`python -m baton.router`."""
from baton.serving.logs import quiet_grpc

quiet_grpc()                    # before grpc is imported: it reads GRPC_VERBOSITY then
from baton.router.main import main  # noqa: E402

main()
