"""OpenAI's Responses API (POST /v1/responses, GET / DELETE /v1/responses/{id}) over the chat
machinery: protocol.py parses and describes the wire shapes, convert.py turns a request and its
stored history into the chat request it is, events.py renders replies as output items and
stream events, store.py keeps responses for previous_response_id. The route is
server/routes/responses.py."""
