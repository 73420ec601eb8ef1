//! The chat template of the reference engine (it has a byte-level tokenizer and no template
//! of its own): each message becomes `"<role>: <content>\n"`, then `"assistant: "` is
//! appended for the model to continue (left out with `add_generation_prompt: false`).

use serde_json::Value;

/// The prompt of a chat: every message as `"<role>: <content>\n"`, then `"assistant: "`.
pub fn chat_prompt(messages: &Value) -> Result<String, String> {
    render(messages, true)
}

/// The prompt of a chat; `generation_prompt` appends `"assistant: "`.
pub fn render(messages: &Value, generation_prompt: bool) -> Result<String, String> {
    let Some(list) = messages.as_array() else {
        return Err("'messages' must be a list of {\"role\", \"content\"} objects".into());
    };
    if list.is_empty() {
        return Err("'messages' is empty; send at least one message".into());
    }
    let mut out = String::new();
    for (i, m) in list.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str);
        let content = match m.get("content") {
            Some(Value::String(s)) => Some(s.clone()),
            // OpenAI's content parts: only text parts carry anything for this model.
            Some(Value::Array(parts)) => parts
                .iter()
                .map(|p| p.get("text").and_then(Value::as_str).map(str::to_owned))
                .collect::<Option<Vec<_>>>()
                .map(|v| v.concat()),
            _ => None,
        };
        match (role, content) {
            (Some(r), Some(c)) => out.push_str(&format!("{r}: {c}\n")),
            _ => return Err(format!("messages[{i}] needs a string 'role' and a text 'content': {m}")),
        }
    }
    if generation_prompt {
        out.push_str("assistant: ");
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn chat_template_is_role_colon_content_lines_then_assistant() {
        let p = chat_prompt(
            &json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]),
        );
        assert_eq!(p.unwrap(), "system: be brief\nuser: hi\nassistant: ");
        let parts = chat_prompt(&json!([{"role": "user", "content": [
            {"type": "text", "text": "a"}, {"type": "text", "text": "b"},
        ]}]));
        assert_eq!(parts.unwrap(), "user: ab\nassistant: ");
        assert_eq!(render(&json!([{"role": "user", "content": "hi"}]), false).unwrap(), "user: hi\n");
    }

    #[test]
    fn chat_template_refuses_what_it_cannot_render() {
        assert!(chat_prompt(&json!([])).unwrap_err().contains("empty"));
        assert!(chat_prompt(&json!("hi")).unwrap_err().contains("list"));
        assert!(chat_prompt(&json!([{"role": "user"}])).unwrap_err().contains("messages[0]"));
    }
}
