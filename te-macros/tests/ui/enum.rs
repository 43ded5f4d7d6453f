use te_macros::Module;

#[derive(Module)]
enum Block {
    Dense(u32),
    Moe(u64),
}

fn main() {}
