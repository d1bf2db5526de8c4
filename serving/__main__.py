from serving.server import main

main()
