from guardian.cli import main

main()
