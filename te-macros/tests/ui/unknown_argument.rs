use te_macros::Module;

#[derive(Module)]
struct Model {
    #[module(rename = "fc1")]
    up: u32,
}

fn main() {}
