#!/bin/bash
printf '#!/bin/bash\nwc -w < "$1"\n' > wordcount.sh
chmod +x wordcount.sh
