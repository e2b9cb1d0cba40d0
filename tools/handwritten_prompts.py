"""Held-out prompts written for this repository, by domain: the held-out source of the chat, writing and
reasoning domains in tools/prompt_sources.py (no public prompt set used for training, and no benchmark,
is their origin). Nothing here is ever trained on."""

CHAT = [
    "What is the difference between a crocodile and an alligator?",
    "How do noise-cancelling headphones work?",
    "I keep forgetting to drink water during the day. Any tricks?",
    "Why do onions make people cry when they cut them?",
    "What should I look for when buying a used bicycle?",
    "Can you explain what a credit score is and how it goes up or down?",
    "Why do cats purr?",
    "What are some ways to make a small apartment feel bigger?",
    "How long should I boil an egg for a soft yolk?",
    "Is it better to rent or buy a home? Give me the main points on each side.",
    "What causes the seasons on Earth?",
    "My houseplant's leaves are turning yellow. What could be wrong?",
    "How do I politely decline an invitation to a party?",
    "What is the difference between baking soda and baking powder?",
    "Why does ice float on water?",
    "How can I get better at remembering people's names?",
    "What are the pros and cons of working from home?",
    "Recommend three board games for a family with young children and say why.",
    "How does a refrigerator keep food cold?",
    "What is jet lag and how can I reduce it?",
    "Explain the rules of chess in a few sentences for a complete beginner.",
    "Why do some people snore?",
    "What is the best way to start running if I have never run before?",
    "How do bees make honey?",
    "What is an index fund?",
    "How do I get a stain of red wine out of a cotton shirt?",
    "What happens in the body when we sleep?",
    "Why is the ocean salty but rivers are not?",
]

WRITING = [
    "Write a short poem about a train station early in the morning.",
    "Write a two-paragraph story about a robot who learns to paint.",
    "Write a cover letter for a junior graphic designer position at a small studio.",
    "Write a friendly reminder email to a neighbour about returning a borrowed ladder.",
    "Write a product description for a handmade wooden chess set.",
    "Write a toast for my sister's wedding. Keep it warm and a little funny.",
    "Rewrite this sentence so that it sounds more confident: 'I think maybe my idea could possibly help the team.'",
    "Write a haiku about a rainy afternoon in the city.",
    "Write the opening paragraph of a mystery novel set in a snowed-in mountain hotel.",
    "Write a short speech that a school principal could give on the first day of the year.",
    "Write a limerick about a forgetful wizard.",
    "Write a diary entry from the point of view of a dog on moving day.",
    "Write an apology message to a customer whose order arrived two weeks late.",
    "Write a short fable with a moral about patience.",
    "Write a description of a busy market in a coastal town, using all five senses.",
    "Write a motivational message for a friend who is about to run their first marathon.",
    "Write a review of an imaginary Italian restaurant, three or four sentences.",
    "Write a dialogue between a lighthouse and a ship during a storm.",
    "Write a short bedtime story about a turtle who wants to fly.",
    "Write a LinkedIn post announcing that I finished a data analysis course.",
    "Write a letter to my future self to be opened in ten years.",
    "Write a slogan and a short tagline for a community garden.",
    "Write a sonnet about the moon, in simple modern English.",
    "Write a short news-style report about a town that holds a giant pumpkin contest.",
    "Write an invitation to a neighbourhood clean-up day this Saturday morning.",
    "Write a scene in which two old friends meet by chance at an airport.",
    "Write a thank-you email to a colleague who covered my shifts while I was sick.",
    "Write a short poem from the point of view of an old oak tree.",
    "Write a persuasive paragraph on why cities should have more public libraries.",
    "Write a recipe introduction for a family pancake recipe, in a cosy blog style.",
    "Write a short horror story in exactly five sentences.",
    "Write the lyrics of a short lullaby about the stars.",
    "Write a job posting for a part-time barista at a small coffee shop.",
    "Write a farewell message to a teacher who is retiring.",
    "Write a short travel blog entry about a day spent in a quiet fishing village.",
]

REASONING = [
    "Anna is taller than Ben. Ben is taller than Carl. Is Carl taller than Anna? Explain.",
    "If all roses are flowers and some flowers fade quickly, can we conclude that some roses fade quickly? "
    "Explain why or why not.",
    "A farmer has to cross a river with a wolf, a goat and a cabbage. The boat carries him and one item. The "
    "wolf eats the goat and the goat eats the cabbage if left alone. How does he get everything across?",
    "Today is Wednesday. What day of the week will it be 100 days from now? Show your reasoning.",
    "Three boxes are labelled 'apples', 'oranges' and 'apples and oranges', and every label is wrong. You may "
    "take one fruit from one box. How can you label all boxes correctly?",
    "If it takes five machines five minutes to make five widgets, how long do 100 machines take to make 100 "
    "widgets? Explain.",
    "Tom's mother has three children: April, May and one more. What is the name of the third child?",
    "A bat and a ball cost 1.10 dollars together. The bat costs one dollar more than the ball. How much does "
    "the ball cost? Explain step by step.",
    "You have a 3-litre jug and a 5-litre jug and unlimited water. How can you measure exactly 4 litres?",
    "Which is heavier, a kilogram of feathers or a kilogram of iron? Explain.",
    "Sara said: 'Every time I wash my car, it rains the next day.' Does washing the car cause rain? Explain "
    "the reasoning error.",
    "Five people finish a race. Dana finishes before Eli but after Finn. Gail finishes last. Hugo finishes "
    "right after Finn. What is the finishing order?",
    "If you are running a race and you pass the person in second place, what place are you in now?",
    "A clock shows 3:15. What is the angle between the hour hand and the minute hand?",
    "What comes next in the sequence 2, 6, 12, 20, 30, ...? Explain the pattern.",
    "A snail climbs 3 metres up a 10-metre wall during the day and slides back 2 metres at night. On which "
    "day does it reach the top?",
    "In a room there are three light switches outside a closed door, and one of them controls the lamp "
    "inside. You may enter the room only once. How can you tell which switch it is?",
    "If some cats are black and all black things absorb heat, what can we say about black cats? What can we not say?",
    "A doctor gives you three pills and tells you to take one every half hour. How long do the pills last?",
    "Is the following argument valid? 'If it is raining, the street is wet. The street is wet. Therefore it "
    "is raining.' Explain.",
    "Mary is 4 years older than her brother. In 6 years the sum of their ages will be 30. How old is each "
    "now? Reason it through.",
    "There are 10 birds on a fence and a hunter shoots one. How many are left on the fence? Think about it "
    "carefully.",
    "Which weighs more when you put it on a scale: a bucket of water, or the same bucket of water with a fish "
    "swimming in it? Explain.",
    "A train leaves at 9:40 and the trip takes 2 hours 35 minutes. When does it arrive? Show the steps.",
    "Paul, Quinn and Rosa each own one pet: a cat, a dog or a parrot. Paul is allergic to fur. Quinn's pet "
    "cannot fly. Rosa does not own the dog. Who owns which pet?",
    "If yesterday was the day before Friday, what day is tomorrow?",
    "A shop raises a price by 10% and then lowers the new price by 10%. Is the final price the same as the "
    "original? Explain.",
    "Explain why the statement 'This sentence is false' causes a problem.",
    "Sort these events in the order they most likely happened: the bread was eaten, the dough rose, the flour "
    "was milled, the bread was baked.",
    "Two coins add up to 30 cents and one of them is not a nickel. What are the two coins?",
    "Four friends sit in a row. Alex is not at either end. Blake sits to the right of Alex. Casey is at the "
    "left end. Where does Drew sit?",
    "If a plant doubles its size every day and covers the whole pond on day 20, on which day did it cover "
    "half the pond?",
    "A man looks at a photo and says: 'Brothers and sisters I have none, but that man's father is my father's "
    "son.' Who is in the photo?",
    "You see a house with two doors: one leads to safety, one to danger. One guard always lies and one always "
    "tells the truth, and you do not know which is which. What single question finds the safe door?",
    "Is every square a rectangle? Is every rectangle a square? Explain the difference.",
    "A recipe for 4 people needs 300 grams of rice. How much rice do you need for 10 people, and how did you "
    "work it out?",
    "Some students in a class play chess, and every chess player also plays cards. Must some students play "
    "cards? Explain.",
    "A store's sales went up the same month it started a new advertisement. Give three other explanations for "
    "the rise besides the advertisement.",
    "What is wrong with this reasoning: 'My grandfather smoked every day and lived to 95, so smoking is not "
    "harmful.'",
    "How many times a day do the hour and minute hands of a clock overlap? Explain.",
    "If the day after tomorrow is Sunday, what day was the day before yesterday?",
    "A box holds red and blue marbles in a ratio of 3 to 2. There are 12 red marbles. How many marbles are in "
    "the box? Explain.",
    "Lena always tells the truth on Mondays and lies on every other day. Today she said, 'I lied yesterday.' "
    "What day is it today?",
    "Which number does not belong in this group, and why: 3, 5, 7, 9, 11?",
    "Plan the order of these morning tasks so that the laundry is done fastest: run the washer (40 minutes), "
    "make breakfast (15 minutes), hang the clothes (10 minutes), shower (10 minutes). Explain.",
]
