from dedup.app.cli import main

main()
