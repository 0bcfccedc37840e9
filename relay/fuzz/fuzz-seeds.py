#!/usr/bin/env python3
"""Write the JSON seed corpora (discovery records, model cards, discovery paths) from the
Dynamo-shaped samples typed out in relay/core/src/inputs/test_fixtures.rs. Run from relay/fuzz."""
import os
import re

FIXTURES = os.path.join("..", "core", "src", "inputs", "test_fixtures.rs")
text = open(FIXTURES).read()

def write(target, name, data):
    os.makedirs(os.path.join("corpus", target), exist_ok=True)
    with open(os.path.join("corpus", target, name), "wb") as out:
        out.write(data)

for name, body in re.findall(r'const (\w+): &str = r#"(.*?)"#;', text, re.S):
    data = body.encode()
    if name.endswith("CARD_JSON"):
        write("model_card", name.lower(), data)
        # The card inside a Model record, as model_record_json writes it.
        record = ('{"type":"Model","namespace":"dynamo","component":"backend",'
                  '"endpoint":"generate","instance_id":13864542646465346627,'
                  '"card_json":' + body + '}')
        write("discovery_record", "model_" + name.lower(), b"\x00" + record.encode())
    else:
        write("discovery_record", name.lower(), b"\x00" + data)
for name, body in re.findall(r'const (\w+_PATH): &str =\s*"(.*?)";', text, re.S):
    write("discovery_record", name.lower(), b"\x01" + body.replace("\\\n", "").encode())
