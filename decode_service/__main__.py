from decode_service.main import main

main()
