# A function shared by the host scripts that read Azure's JSON replies (acr-login.sh, munge-key.sh).
# Not a program: render_script pastes it where a template says `# include json-field.sh`.

# Prints one field of the JSON object on stdin; on failure names the field, never the document.
json_field() {
  python3 -c '
import json, sys
value = json.load(sys.stdin).get(sys.argv[1])
if not value:
    sys.exit("response has no " + sys.argv[1])
print(value)
' "$1"
}
